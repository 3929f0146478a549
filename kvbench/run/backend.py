"""The backend protocols: the narrow interface between the replay runner (core) and every backend.

The runner owns reading and validating the trace, pacing, collecting results and writing the run
directory; a backend only answers requests. Backends are plug-ins found through the `kvbench.backends`
entry-point group (`kvbench.run.plugins`), never imported by the core; a third-party one is an ordinary
distribution with such an entry point (tests/plugins/kvbench-example-backend is one).

A backend declares which protocol it implements with its class attribute `kind`, and the runner takes one
path per protocol (it never probes for methods):

- `OfflineBackend` (kind "offline", the simulators) answers a whole trace at once, in arrival order, for
  each of its configuration points (e.g. policy x capacity), yielding one `PointResult` per point as soon as
  it is done, so the runner can write it before the next one starts.
- `StreamingBackend` (kind "streaming") is an offline backend that can also replay a trace in bounded
  memory (`kvbench replay --stream`): `replay_stream` yields one `StreamedPoint` per configuration point,
  which the runner feeds the trace chunk by chunk. The runner reads the chunks and owns what is made of the
  answers (requests.parquet, the summary's metrics), so nothing per request outlives its chunk, whatever the
  length of the trace. It may also yield a `PointResult` without a hit_blocks column (facts only, e.g. a curve
  it computed by its own pass over the chunks), for which the runner writes no rows. Either protocol yields a
  `Skipped` for a part it was asked for and left out.
- `OnlineBackend` (kind "online") answers requests one at a time over the network: the core's dispatcher
  (`kvbench.run.pacing`) sends each request with `send` at its scheduled time, inside `connect`.

Callbacks are arguments, never attributes the runner sets: an offline backend whose points take long calls
the `progress` it is given with a `Progress`.

Optional: an offline backend that takes part in `kvbench demo` is also a `DemoGrid` (has a classmethod
`demo_options(trace, meta) -> dict`); the demo asks `issubclass(cls, DemoGrid)`. One that keeps what it
prepares from a trace in the trace cache is also a `TraceCacheUser` (has `replay_cached`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from types import FunctionType
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

import click
import numpy as np
import pyarrow as pa

from kvbench.options import PolicyOption  # noqa: F401  (declared with the option mechanism; plug-ins take it from here too)
from kvbench.registry import Registry
from kvbench.run.pointnames import point_name
from kvbench.trace.files import TraceMeta

if TYPE_CHECKING:
    from kvbench.run.pacing import Outcome, Pacing
    from kvbench.trace.scan import ScannedTrace


@dataclass
class Progress:
    """How far an offline point is: what a backend whose points take long passes to the `progress` callback
    the runner gives `replay`."""

    done: int
    total: int
    what: str


@dataclass
class PointResult:
    """One configuration's answers. `columns` are per-request arrays aligned with the trace rows, named
    as in `kvbench.run.results.RESULT_SCHEMA` (hit_blocks, hit_tokens, evictions, ttft_s, …)."""

    labels: dict  # what identifies the point, e.g. {"policy": "lru", "capacity_blocks": 10000}
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # JSON-ready facts for the summary (matrices, flags, curves)

    @property
    def name(self) -> str:
        """e.g. "lru/1000blocks": each number with its unit (`kvbench.run.pointnames`)."""
        return point_name(self.labels)


@dataclass
class Skipped:
    """A part of the run a backend was asked for and left out (e.g. the Belady bound of a streamed replay):
    `replay` or `replay_stream` yields it in place of that part's points, and the runner says so on the terminal
    and in summary.json's `skipped`, so a run never looks as if it measured what it did not."""

    what: str  # e.g. "belady bound"
    why: str  # the reason and what to do instead


class StreamedPoint(Protocol):
    """One configuration's answers to a streamed trace. The runner calls `answer` with every chunk of the
    trace in row order, then `finish` once."""

    labels: dict  # as in PointResult

    def answer(self, chunk: pa.RecordBatch) -> dict[str, np.ndarray]:
        """Per-request arrays for the chunk's rows, named as in `kvbench.run.results.RESULT_SCHEMA` (hit_blocks
        at least). `chunk` has block_hashes and the trace's `scan.REPLAY_COLUMNS`, cast to the schema."""
        ...

    def finish(self) -> dict:
        """The point's facts for the summary, after the last chunk: as `PointResult.extra` (an evict_matrix
        and its tenant_names become the metrics' fairness.evictor_victim)."""
        ...


ProgressCallback = Callable[[Progress], None]


class Backend(Protocol):
    """What every backend has, whatever its protocol."""

    name: ClassVar[str]
    kind: ClassVar[str]  # "offline", "streaming" or "online": the protocol below that the class implements

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        """Backend-specific `kvbench replay` options (each with help that states units). The constructor takes
        them as keyword arguments, named as click names them (--kv-dtype: kv_dtype)."""
        ...

    def config(self) -> dict:
        """The backend's settings as they go into summary.json (never secrets)."""
        ...


# The protocols a backend's `kind` names, registered where each is declared.
PROTOCOLS: Registry[type] = Registry(None, "backend protocol")


@PROTOCOLS.register("offline")
class OfflineBackend(Backend, Protocol):
    kind: ClassVar[Literal["offline", "streaming"]]

    def replay(
        self, trace: pa.Table, meta: TraceMeta, progress: ProgressCallback | None = None
    ) -> Iterator[PointResult]:
        """Answer every request of a validated trace, once per configuration point. `progress`, when given,
        may be called with a `Progress` while a point runs (the runner reports each finished point itself)."""
        ...


@PROTOCOLS.register("streaming")
class StreamingBackend(OfflineBackend, Protocol):
    kind: ClassVar[Literal["streaming"]]

    def replay_stream(
        self, scanned: ScannedTrace, progress: ProgressCallback | None = None
    ) -> Iterator[StreamedPoint | PointResult]:
        """The points of `replay`, each answering the trace chunk by chunk (`StreamedPoint`) or, with no rows,
        as a `PointResult` without hit_blocks, and a `Skipped` for any part of them that cannot be streamed."""
        ...


@PROTOCOLS.register("online")
class OnlineBackend(Backend, Protocol):
    kind: ClassVar[Literal["online"]]
    pacing: Pacing  # when requests are sent (`kvbench.run.pacing`); read by the runner, never changed by it
    slo: dict | None  # latency objectives for the summary (`kvbench.metrics.latency`), or None

    def connect(self, trace: pa.Table, meta: TraceMeta, origin: float) -> AbstractAsyncContextManager:
        """Open the client for a run (`origin`: the time.perf_counter() value of the run's time 0); requests
        are sent while it is entered."""
        ...

    async def send(self, outcome: Outcome) -> None:
        """Send the request of trace row `outcome.row` and fill in `outcome` (times, status, cached tokens)."""
        ...

    def extra(self) -> dict:
        """After the run: facts for the summary (`server`: counters before and after, `model`)."""
        ...


@runtime_checkable
class DemoGrid(Protocol):
    """The optional part of the offline protocols that `kvbench demo` uses: a backend class that has it
    is replayed by the demo with the grid it gives."""

    @classmethod
    def demo_options(cls, trace: pa.Table, meta: TraceMeta) -> dict:
        """The options (as `kvbench replay` would pass them) of a small, telling grid for `trace`."""
        ...


@runtime_checkable
class TraceCacheUser(Protocol):
    """The optional part of the offline protocols for a backend that keeps what it prepares from a trace in the
    trace cache (`kvbench.run.tracecache`; the sim backend keeps its dense block keys). The runner then calls
    `replay_cached` instead of `replay`, with the trace's entry, or None when the cache is off: the trace comes
    without its block_hashes column when the entry already held it, and the backend loads what it prepared
    before from `cache`, or reads the block ids back (`cache.block_hashes`) and stores what it prepares."""

    def replay_cached(
        self, trace: pa.Table, meta: TraceMeta, cache, progress: ProgressCallback | None = None
    ) -> Iterator[PointResult | Skipped]: ...


def methods_of(protocol: type) -> tuple[str, ...]:
    """The methods a protocol declares, its bases' first: what a class of that kind must define (its data
    members, pacing and slo of the online one, belong to instances and are not checked here)."""
    names: list[str] = []
    for base in reversed(protocol.__mro__):
        if base is Protocol or not getattr(base, "_is_protocol", False):
            continue
        for member, value in vars(base).items():
            method = isinstance(value, FunctionType | classmethod | staticmethod)
            if method and not member.startswith("_") and member not in names:
                names.append(member)
    return tuple(names)


def protocol_of(backend, name: str | None = None) -> type:
    """The protocol a backend class (or instance) declares with `kind`; raises TypeError, naming what is
    missing, when it declares none or lacks a method of the one it declares. `name`: its entry-point name."""
    cls = backend if isinstance(backend, type) else type(backend)
    name = name or getattr(cls, "name", None) or cls.__qualname__
    kind = getattr(cls, "kind", None)
    kinds = ", ".join(f"kind = {k!r} ({p.__name__})" for k, p in PROTOCOLS.items())
    if kind not in PROTOCOLS:
        declared = "declares no kind" if kind is None else f"declares kind = {kind!r}"
        raise TypeError(
            f"backend {name} implements none of the kvbench backend protocols (kvbench.run.backend): "
            f"{cls.__module__}.{cls.__qualname__} {declared}; declare one of {kinds}"
        )
    missing = [m for m in methods_of(PROTOCOLS[kind]) if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(
            f"backend {name} implements none of the kvbench backend protocols (kvbench.run.backend): "
            f"{cls.__module__}.{cls.__qualname__} declares kind = {kind!r} ({PROTOCOLS[kind].__name__}) "
            f"but has no {', '.join(missing)}"
        )
    return PROTOCOLS[kind]


def is_online(backend) -> bool:
    """Whether a backend (class or instance) declares the online protocol."""
    return protocol_of(backend) is OnlineBackend
