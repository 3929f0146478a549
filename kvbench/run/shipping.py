"""A sweep's points on other machines without a shared filesystem (the `ray` executor): each trace goes to
the workers once through Ray's object store, and each point's run directory comes back to the driver as an
archive that is unpacked into the sweep folder. No node needs the driver's paths, and the driver needs none of
theirs.

On a worker a shipped trace is written once per node, under the system's temporary folder in a directory
named by its SHA-256 (`kvbench-traces/<digest>/<file name>`), so the points that follow on that node find it
there, and so does the trace cache (kvbench.run.tracecache). A point runs in a private temporary folder that is
removed once its archive is made; the summary and reports name the trace as the sweep was given it.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import socket
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError

SHIPPED_DIR = "kvbench-traces"


def share_traces(put, traces: list[str]) -> dict[str, tuple[Any, str]]:
    """Each trace file's bytes into the object store (`put`: ray.put): path -> (reference, SHA-256). All are read
    before the first `put` joins the cluster: in a Ray job, joining it may take this process's folder away."""
    data = {}
    for path in dict.fromkeys(traces):
        if not Path(path).is_file():
            raise KvbenchError(f"{path}: no such trace file (a sweep sends each trace file to its Ray workers)")
        data[path] = Path(path).read_bytes()
    return {path: (put(b), hashlib.sha256(b).hexdigest()) for path, b in data.items()}


@dataclass(frozen=True)
class ShippedTask:
    """A PointTask run on any node: the trace from the object store, the run directory back as an archive."""

    task: Any  # kvbench.run.sweeps.PointTask
    traces: dict[str, tuple[Any, str]]  # as share_traces returns

    def __call__(self, point) -> dict:
        import ray

        ref, digest = self.traces[point.trace]
        local = materialize(ray.get(ref), digest, Path(point.trace).name)
        work = Path(tempfile.mkdtemp(prefix="kvbench-point-"))
        try:
            here = replace(self.task, cwd=os.getcwd())  # (the sweep's folder may not exist on this node)
            outcome = here(replace(point, trace=str(local)), trace_label=point.trace, into=str(work))
            run_dir = work / point.name
            archive = pack(run_dir) if run_dir.is_dir() else None
        finally:
            shutil.rmtree(work, ignore_errors=True)
        node = ray.get_runtime_context().get_node_id()
        return {**outcome, "host": socket.gethostname(), "node": node, "archive": archive}


def materialize(data: bytes, digest: str, name: str) -> Path:
    """The trace's bytes as a file on this node, written once (atomically: a reader never sees half of it)."""
    folder = Path(tempfile.gettempdir()) / SHIPPED_DIR / digest
    path = folder / name
    if path.is_file() and path.stat().st_size == len(data):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".incoming-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def pack(run_dir: Path) -> bytes:
    """The run directory as an uncompressed tar (Parquet and reports compress themselves)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(run_dir, arcname=run_dir.name)
    return buf.getvalue()


def unpack(outcome: dict, out_dir: Path, name: str) -> dict:
    """Put a shipped point's run directory into the sweep folder (replacing an unfinished one of an earlier
    try); returns the outcome without its archive, for sweep.json."""
    archive = outcome.get("archive")
    rest = {k: v for k, v in outcome.items() if k != "archive"}
    if archive is None:
        return rest
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.incoming-", dir=out_dir))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(staging, filter="data")  # (the data filter refuses links out and absolute names)
        target = out_dir / name
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return rest
