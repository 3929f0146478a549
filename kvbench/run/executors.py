"""Where a sweep's points run: in this process (`local`), in a pool of processes on this machine (`process`),
or as Ray tasks on a local or existing cluster (`ray`).

A pool only starts tries of points and says when each ends; the retry loop (`run_points`) is written once
above them, so that a point that raised, returned a failure, or lost its worker is retried and counted the
same way everywhere, and reported with its attempts and last error once it has none left. A task is any
picklable callable point -> outcome dict (kvbench.run.sweeps.PointTask); the same code writes the same run
directories whichever pool runs it.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench.errors import KvbenchError
from kvbench.registry import Registry

Task = Callable[[Any], dict]  # point -> outcome {"status": "ok" | "skipped" | "failed", "error": …, …}
DEFAULT_RETRIES = 2
UNLIMITED = sys.maxsize
EXECUTORS: Registry[type[PointPool]] = Registry(None, "executor")  # filled by @executor below


def executor(name: str):
    """Registers a pool class under `name`; its docstring's first line is its --help text."""

    def add(cls):
        cls.name = name
        EXECUTORS.add(name, cls)
        return cls

    return add


def describe() -> str:
    return "; ".join(f"{n} = {cls.__doc__.strip().splitlines()[0].rstrip('.')}" for n, cls in EXECUTORS.items())


@dataclass(frozen=True)
class ExecutorSettings:
    executor: str = "local"
    workers: int | None = None  # None: not given (the pool's own size; live points one at a time)
    retries: int = DEFAULT_RETRIES
    ray_address: str = ""  # "": a new local cluster of `workers` CPUs; "auto", "host:6379", "ray://host:10001"
    ray_cpus_per_point: float = 1.0

    def check(self) -> None:
        if self.executor not in EXECUTORS:
            raise KvbenchError(f"unknown executor {self.executor!r}; choose one of: {', '.join(EXECUTORS)}")
        if self.retries < 0:
            raise KvbenchError(f"--retries {self.retries}: give 0 (no retry) or more")
        if self.workers is not None and self.workers < 1:
            raise KvbenchError(f"--workers {self.workers}: give 1 or more points at once")
        if self.executor == "local" and (self.workers or 1) > 1:
            raise KvbenchError("--workers runs points side by side: add --executor process (or ray)")
        if self.executor != "ray" and (self.ray_address or self.ray_cpus_per_point != 1.0):
            raise KvbenchError(
                "--ray-address and --ray-cpus-per-point apply to --executor ray only: add it, or leave them out"
            )


def worker_died(detail: str) -> dict:
    return {"status": "failed", "error": f"worker died: {detail}", "seconds": None}


def one_line(exc: BaseException) -> str:
    """An error for sweep.json: a KvbenchError's message as it is (it says what to do), else type: first line."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    return msg if isinstance(exc, KvbenchError) else f"{type(exc).__name__}: {msg}"


def raised(exc: BaseException) -> dict:
    return {"status": "failed", "error": one_line(exc), "seconds": None}


class PointPool:
    """Base: a queue of tries, at most `limit` of them running; subclasses start one and wait for some."""

    name: ClassVar[str]

    def __init__(self, settings: ExecutorSettings, say: Callable[[str], None]):
        self.settings, self.say = settings, say
        self.limit = self.default_limit()
        self.here = False  # the tries being queued must run on this machine (a live point's 127.0.0.1 URL)
        self._queue: deque[tuple[Task, Any, bool]] = deque()
        self._running: dict[Any, tuple[Task, Any, bool]] = {}  # handle -> (task, point, here)
        self._done: deque[tuple[Any, dict]] = deque()

    def default_limit(self) -> int:
        return self.settings.workers or os.cpu_count() or 1

    def submit(self, task: Task, point, first: bool = False) -> None:
        (self._queue.appendleft if first else self._queue.append)((task, point, self.here))

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._running or self._done)

    def next_done(self) -> tuple[Any, dict]:
        """(point, outcome) of the next try to end, in the order they end."""
        while not self._done:
            self._fill()
            self._done.extend(self._wait())
        return self._done.popleft()

    def _fill(self) -> None:
        while self._queue and len(self._running) < self.limit:
            task, point, here = self._queue.popleft()
            self._running[self._start(task, point, here)] = (task, point, here)

    def _start(self, task: Task, point, here: bool):  # -> a handle
        raise NotImplementedError

    def _wait(self) -> list[tuple[Any, dict]]:  # blocks until at least one running try ends
        raise NotImplementedError

    def close(self, interrupted: bool = False) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(interrupted=exc_type is not None)


def open_pool(settings: ExecutorSettings, say: Callable[[str], None] = lambda msg: None) -> PointPool:
    settings.check()
    return EXECUTORS[settings.executor](settings, say)


def run_points(
    pool: PointPool,
    task: Task,
    points: list,
    retries: int = DEFAULT_RETRIES,
    limit: int | None = None,
    here: bool = False,
    on_retry: Callable[[Any, int, str], None] | None = None,
) -> Iterator[tuple[Any, dict]]:
    """Runs every point, at most `limit` at once (None: the pool's size); yields (point, outcome) as each ends
    for good. A failed try is retried at once, up to `retries` more times; the outcome carries `attempts`,
    and `errors` (every failed try's error, in order) when any failed."""
    pool.limit, pool.here = limit or pool.default_limit(), here
    tries: dict[str, int] = {}
    errors: dict[str, list[str]] = {}
    for p in points:
        tries[p.name] = 1
        pool.submit(task, p)
    while pool.busy:
        p, outcome = pool.next_done()
        if outcome.get("status") == "failed":
            errors.setdefault(p.name, []).append(outcome.get("error") or "failed without an error message")
            if tries[p.name] <= retries:
                if on_retry:
                    on_retry(p, tries[p.name], errors[p.name][-1])
                tries[p.name] += 1
                pool.submit(task, p, first=True)
                continue
        yield p, {**outcome, "attempts": tries[p.name], **({"errors": errors[p.name]} if p.name in errors else {})}


@executor("local")
class LocalPool(PointPool):
    """one point after another, in this process."""

    def default_limit(self) -> int:
        return 1

    def _start(self, task, point, here):
        return object()

    def _wait(self):
        handle, (task, point, _) = next(iter(self._running.items()))
        del self._running[handle]
        try:
            return [(point, task(point))]
        except Exception as exc:  # noqa: BLE001 - counted as a failed try, like a worker's exception
            return [(point, raised(exc))]


def _run_task(task: Task, point) -> dict:
    return task(point)


@executor("process")
class ProcessPool(PointPool):
    """a pool of --workers processes on this machine (default: one per CPU)."""

    # A worker that dies breaks the whole ProcessPoolExecutor: every try in flight fails with
    # BrokenProcessPool and none says which one killed it. So a try is only counted as failed when it was
    # alone in the pool; the others ("suspects") are run again one at a time, uncounted, until it is.

    def __init__(self, settings, say):
        super().__init__(settings, say)
        self._executor: ProcessPoolExecutor | None = None
        self._suspects: set[str] = set()

    def _fill(self):
        while self._queue and len(self._running) < self.limit:
            _, point, _ = self._queue[0]
            running_suspect = any(p.name in self._suspects for _, p, _ in self._running.values())
            if self._running and (point.name in self._suspects or running_suspect):
                return
            task, point, here = self._queue.popleft()
            self._running[self._start(task, point, here)] = (task, point, here)

    def _start(self, task, point, here):
        if self._executor is None:
            import multiprocessing

            # spawn, not fork: the parent has threads (the progress bar), which fork would copy mid-lock
            self._executor = ProcessPoolExecutor(
                self.settings.workers or os.cpu_count(), mp_context=multiprocessing.get_context("spawn")
            )
        return self._executor.submit(_run_task, task, point)

    def _wait(self):
        done, _ = wait(list(self._running), return_when=FIRST_COMPLETED)
        if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
            wait(list(self._running))  # a broken pool fails everything it held
            done = set(self._running)
        out, broken = [], []
        for f in done:
            task, point, here = self._running.pop(f)
            exc = f.exception()
            if isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt
            if isinstance(exc, BrokenProcessPool):
                broken.append((task, point, here))
            else:
                self._suspects.discard(point.name)
                out.append((point, raised(exc) if exc is not None else f.result()))
        if broken:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if len(broken) == 1:
            self._suspects.discard(broken[0][1].name)
            out.append((broken[0][1], worker_died("its process ended abruptly (killed, or crashed)")))
        elif broken:
            self._suspects.update(p.name for _, p, _ in broken)
            self._queue.extendleft(reversed(broken))
        return out

    def close(self, interrupted=False):
        if self._executor is not None:
            self._executor.shutdown(wait=not interrupted, cancel_futures=True)


@executor("ray")
class RayPool(PointPool):
    """each point a Ray task, on a new local cluster of --workers CPUs or the cluster at --ray-address."""

    # Ray's own retries (max_retries) cover worker deaths only, application errors need retry_exceptions;
    # both are off so that run_points counts every kind of failed try the same way as the other pools.

    def __init__(self, settings, say):
        super().__init__(settings, say)
        try:
            import ray
        except ImportError:
            raise KvbenchError(
                "--executor ray needs Ray, which is not installed; install it: pip install 'kvbench[ray]'"
            ) from None
        self.ray, self.started, self._remote = ray, False, None

    def _connect(self) -> None:
        """Starts or joins the cluster when the first point is sent (a resumed sweep may send none)."""
        ray, settings = self.ray, self.settings
        if not ray.is_initialized():  # else: a caller (a test, a notebook) connected it already; use that
            import logging

            # inside a Ray job (`ray job submit`) Ray names the cluster in RAY_ADDRESS: join it, as ray.init would
            address = settings.ray_address or os.environ.get("RAY_ADDRESS") or "local"
            kwargs = {"num_cpus": settings.workers or os.cpu_count()} if address == "local" else {}
            try:
                init_ray(
                    ray, address, self.say, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
                    **kwargs,
                )  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise KvbenchError(
                    f"could not start or reach a Ray cluster at {address!r}: {str(exc).splitlines()[0]}; for a "
                    "cluster, run `ray start --head` on one node and give --ray-address auto (on a node), "
                    "host:6379 or ray://host:10001"
                ) from None
            self.started = True
        self._remote = ray.remote(max_retries=0, retry_exceptions=False)(_run_task)

    def share(self, data):
        """`data` in the cluster's object store, for the tasks to read (kvbench.run.shipping)."""
        if self._remote is None:
            self._connect()
        return self.ray.put(data)

    def default_limit(self) -> int:
        # the cluster schedules tries by their CPUs; an explicit --workers caps how many run at once
        return self.settings.workers or UNLIMITED

    def _start(self, task, point, here):
        if self._remote is None:
            self._connect()
        options: dict = {"num_cpus": self.settings.ray_cpus_per_point}
        node = self._node_here() if here else None
        if node:  # the node of this process, which can reach the live point's 127.0.0.1 URL
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        return self._remote.options(**options).remote(task, point)

    def _node_here(self) -> str | None:
        try:
            return self.ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - a Ray Client driver (ray://) is on no node: let Ray place it
            return None

    def _wait(self):
        from ray.exceptions import RayError, RayTaskError, TaskCancelledError

        ready, _ = self.ray.wait(list(self._running), num_returns=1)
        out = []
        for ref in ready:
            _, point, _ = self._running.pop(ref)
            try:
                out.append((point, self.ray.get(ref)))
            except RayTaskError as exc:  # the task raised: its own exception, without Ray's traceback
                cause = getattr(exc, "cause", None) or exc
                if isinstance(cause, KeyboardInterrupt):
                    raise KeyboardInterrupt from None
                out.append((point, raised(cause)))
            except TaskCancelledError:
                raise KeyboardInterrupt from None
            except RayError as exc:  # the worker process or its node died, or ran out of memory
                out.append((point, worker_died(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")))
        return out

    def close(self, interrupted=False):
        if interrupted:
            for ref in self._running:
                self.ray.cancel(ref, force=True)
        if self.started:
            self.ray.shutdown()


RAY_CLIENT_TRIES = 3


def init_ray(ray, address: str, say: Callable[[str], None], **kwargs) -> None:
    """`ray.init(address=address, **kwargs)`, with a Ray Client address (ray://) tried again when the head could not
    start this client's server. Ray's client proxy starts one server process per client, and on a busy head that
    start sometimes fails at once (the head's ray_client_server.err says "SpecificServer startup failed"; the
    client gets "Initialization failure from server"). The proxy cleans up and a new connection gets a new server,
    so it is worth a second try; other errors are raised at once."""
    for attempt in range(1, RAY_CLIENT_TRIES + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except ConnectionAbortedError as exc:  # (a ConnectionError: the callers report the last one)
            if not str(address).startswith("ray://") or attempt == RAY_CLIENT_TRIES:
                raise
            ray.shutdown()
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            say(f"Ray Client {address}: {first}; connecting again ({attempt} of {RAY_CLIENT_TRIES - 1} retries)")
            time.sleep(2.0 * attempt)
