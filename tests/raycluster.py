"""A multi-node Ray cluster on this machine for the tests: a head that runs no task (0 CPUs) and worker nodes of
1 CPU each, every node its own raylet, object store and worker processes (Ray's own multi-node test cluster,
`ray.cluster_utils.Cluster`). It runs in a controller process of its own, so that the test process stays free
to join any other cluster; the controller takes commands on stdin:

    kill N     remove the Nth live worker node (its raylet and workers die, as when a machine is lost)
    add        start one more worker node
    quit       shut the cluster down

and answers each with one line. Run as `python tests/raycluster.py NODES`; the first line it prints is the
cluster's address (for `--ray-address`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main(n_nodes: int) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(n_nodes)]
    cluster.wait_for_nodes()
    print(cluster.address, flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["kill"]:
                cluster.remove_node(nodes.pop(int(cmd[1])), allow_graceful=False)
                print("killed", flush=True)
            elif cmd[:1] == ["add"]:
                nodes.append(cluster.add_node(num_cpus=1))
                cluster.wait_for_nodes()
                print("added", flush=True)
            elif cmd[:1] == ["quit"]:
                break
    finally:
        cluster.shutdown()


class ClusterProcess:
    """The controller, from a test: `address`, `kill(n)`, `add()`, `close()`."""

    def __init__(self, n_nodes: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(n_nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.proc.wait(timeout=60)
            raise RuntimeError(f"the Ray test cluster did not start (exit status {self.proc.returncode})")

    def _command(self, text: str) -> str:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self, n: int) -> None:
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
