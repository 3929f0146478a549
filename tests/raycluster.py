"""A multi-node Ray cluster on this machine for the tests: a head that runs no task (0 CPUs) and worker nodes of
1 CPU each, every node its own raylet, object store and worker processes (Ray's own multi-node test cluster,
`ray.cluster_utils.Cluster`). It runs in a controller process of its own, so that the test process stays free
to join any other cluster; the controller takes commands on stdin:

    kill N     remove the Nth live worker node (its raylet and workers die, as when a machine is lost)
    kill busy  remove a worker node that runs a task now (waits up to 60 s for one; needs the dashboard's
               state API, else the first live node)
    add        start one more worker node
    quit       shut the cluster down

and answers each with one line. Run as `python tests/raycluster.py NODES`; the first line it prints is JSON:
the cluster's address (for `--ray-address`), its job server's (`ray job submit --address`, null without Ray's
dashboard extra) and its Ray Client address (`ray://…`, null without Ray's client extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def main(n_nodes: int) -> None:
    from ray.cluster_utils import Cluster

    store = {"object_store_memory": 128 * 2**20}  # small (the tests move small traces): three nodes fit any /dev/shm
    head: dict = {"num_cpus": 0, **store}
    dashboard = client = None
    if _importable("aiohttp_cors"):  # ray[default]: the dashboard, which serves `ray job submit`
        port = free_port()
        head |= {"include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
                 # (its own agent port: another Ray on this machine, e.g. the tests' session cluster, holds Ray's
                 # default one, and the job server then has no agent to run jobs)
                 "dashboard_agent_listen_port": free_port()}  # fmt: skip
        dashboard = f"http://127.0.0.1:{port}"
    if _importable("grpc"):  # ray[client]
        port = free_port()
        head["ray_client_server_port"] = port
        client = f"ray://127.0.0.1:{port}"
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    nodes = [cluster.add_node(num_cpus=1, **store) for _ in range(n_nodes)]
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "dashboard": dashboard, "client": client}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["kill"]:
                n = _busy_node(nodes, dashboard) if cmd[1] == "busy" else int(cmd[1])
                node = nodes.pop(n)
                # a lost machine takes its running tasks with it: the raylet's worker processes too (left alone,
                # a busy worker may finish its task and hand the result to the driver after its node died)
                workers = [p for info in node.all_processes.get("raylet", ()) for p in _descendants(info.process.pid)]
                cluster.remove_node(node, allow_graceful=False)
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                print("killed", flush=True)
            elif cmd[:1] == ["add"]:
                nodes.append(cluster.add_node(num_cpus=1, **store))
                cluster.wait_for_nodes()
                print("added", flush=True)
            elif cmd[:1] == ["quit"]:
                break
    finally:
        cluster.shutdown()


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (no psutil needed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # (ended meanwhile)
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _busy_node(nodes: list, dashboard: str | None) -> int:
    """The index of a live worker node with a running task (the first node without the state API)."""
    if dashboard is None:
        return 0
    from ray.util.state import list_tasks

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = {t.node_id for t in list_tasks(address=dashboard, filters=[("state", "=", "RUNNING")])}
        for i, node in enumerate(nodes):
            if node.node_id in running:
                return i
        time.sleep(0.05)
    return 0


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (also for benchmarks/ray_nodes.py, which imports this module)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClusterProcess:
    """The controller, from a test: `address`, `kill(n)`, `add()`, `close()`."""

    def __init__(self, n_nodes: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(n_nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = self.proc.stdout.readline().strip()
        if not first:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"the Ray test cluster did not start (exit status {self.proc.returncode})")
        found = json.loads(first)
        self.address, self.dashboard, self.client = found["address"], found["dashboard"], found["client"]

    def _command(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self, n: int | str) -> None:
        """Remove the nth live worker node, or with "busy" one that runs a task now."""
        assert self._command(f"kill {n}") == "killed"

    def add(self) -> None:
        assert self._command("add") == "added"

    def close(self) -> None:
        try:
            self._command("quit")
            self.proc.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()


if __name__ == "__main__":
    main(int(sys.argv[1]))
