"""One load generator of a distributed live replay: a Ray actor that runs the ordinary dispatcher and backend
client on its shard of the trace, and hands its outcomes to the driver in batches (`kvbench.live.distributed`).

Its clock is the run's shared one: the driver names a wall-clock start instant, and the worker maps the
trace's offsets onto its own monotonic clock from that instant, so that every worker's times (scheduled,
sent, chunks) are seconds since the same start. Outcomes carry shard-local row numbers; the driver maps them
back to the trace's."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time

import numpy as np
import pyarrow as pa

from kvbench.live.dispatch import dispatch
from kvbench.run.backend import OnlineBackend
from kvbench.run.pacing import Outcome
from kvbench.run.plugins import load_backend
from kvbench.trace.files import TraceMeta


class LoadWorker:
    """Built by the driver with its shard's rows (never the trace file: workers need not see the driver's
    disk) and their offsets in the whole trace's schedule. Made a Ray actor by `ray.remote`, async so that
    `take` runs on the same event loop as the requests, between them."""

    def __init__(
        self,
        backend_name: str,
        backend_options: dict,
        shard: pa.Table,
        meta: TraceMeta,
        offsets: np.ndarray,
        clock_at_start: float = 0.0,
    ):
        # The backend is built here, from its options: an API key is read from this machine's environment when
        # the client connects, and never travels with the options.
        self.backend: OnlineBackend = load_backend(backend_name)(**backend_options)
        # The driver has already cut the trace to --max-requests and picks the warm-up requests across workers:
        # this worker's dispatcher paces its shard without either (the backend's own pacing is left as built).
        self.pacing = dataclasses.replace(self.backend.pacing, max_requests=None, warmup_requests=0)
        self.shard, self.meta, self.offsets = shard, meta, offsets
        self.clock_at_start = clock_at_start  # a resumed run's clock goes on from where it stopped
        self.outcomes = [Outcome(row=i) for i in range(shard.num_rows)]
        self.finished: list[Outcome] = []  # answered since the driver last took them
        self.delivered: set[int] = set()
        self.sending: asyncio.Task | None = None
        self.stopping = False

    def where(self) -> dict:
        import ray

        return {"host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def run(self, start_wall: float) -> dict:
        """Connect, wait for the shared start (`start_wall`, a time.time() instant), send the shard; returns the
        outcomes not taken yet and what the driver needs for the summary."""
        # perf_counter value at which the shared clock reads `clock_at_start`: monotonic from here on, so that a
        # wall-clock step during the run cannot move the schedule
        origin = time.perf_counter() + (start_wall - time.time()) - self.clock_at_start

        def now() -> float:
            return time.perf_counter() - origin

        async with self.backend.connect(self.shard, self.meta, origin):
            connected_at = now() - self.clock_at_start  # > 0: this worker missed the start and runs late
            if connected_at < 0:
                await asyncio.sleep(-connected_at)
            if not self.stopping:  # (stopped before the start: nothing is sent)
                self.sending = asyncio.ensure_future(
                    dispatch(
                        self.shard,
                        self.pacing,
                        self.outcomes,
                        self.backend.send,
                        self.finished.append,
                        origin,
                        offsets=self.offsets,
                        start_at=self.clock_at_start,
                    )
                )
                try:
                    await self.sending
                except asyncio.CancelledError:
                    if not self.stopping:
                        raise
            # taken before the backend's closing /metrics scrape starts, so that the driver can pick the scrape
            # that follows every worker's last answer (a worker that finishes later scrapes later)
            sent_until = now()
        return {
            "rest": self._undelivered(everything=True),
            "extra": self.backend.extra(),
            "connected_at_s": connected_at,
            "sent_until_s": sent_until,
        }

    async def take(self) -> list[Outcome]:
        """The outcomes answered since the last call (the driver polls)."""
        return self._undelivered()

    async def stop(self) -> None:
        """The driver was interrupted: cancel the requests in flight (recorded as cancelled); `run` returns."""
        self.stopping = True
        if self.sending is not None:
            self.sending.cancel()

    def _undelivered(self, everything: bool = False) -> list[Outcome]:
        batch = list(self.finished)
        self.finished.clear()  # in place: the dispatcher appends to this very list
        if everything:  # the run is over: also the requests never sent (a --duration cut, a stop)
            taken = self.delivered | {o.row for o in batch}
            batch += [o for o in self.outcomes if o.row not in taken]
        self.delivered.update(o.row for o in batch)
        return batch
