"""The Backend protocol: the narrow interface between the replay runner (core) and every backend.

The runner owns reading and validating the trace, pacing, collecting results and writing the run
directory; a backend only answers requests. Backends are plug-ins found through the `kvbench.backends`
entry-point group (`kvbench.plugins`), never imported by the core.

An *offline* backend (the simulators) answers a whole trace at once, in arrival order, for each of its
configuration points (e.g. policy x capacity), yielding one `PointResult` per point as soon as it is done,
so the runner can write it before the next one starts.

An offline backend that can replay a trace in bounded memory (`kvbench replay --stream`) also has
`replay_stream(scanned: tracescan.ScannedTrace) -> Iterator[StreamedPoint]`: one `StreamedPoint` per
configuration point, which the runner feeds the trace chunk by chunk. The runner reads the chunks and owns
what is made of the answers (requests.parquet, the summary's metrics), so nothing per request outlives its
chunk, whatever the length of the trace.

An offline backend that takes part in `kvbench demo` has a classmethod `demo_options(trace, meta) -> dict`:
the options (as `kvbench replay` would pass them) of a small, telling grid for that trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import click
import numpy as np
import pyarrow as pa

from .traceio import TraceMeta


@dataclass
class Progress:
    """How far an offline point is: a backend whose points take long has a `progress` attribute, which the
    runner sets to a callable taking one of these."""

    done: int
    total: int
    what: str


@dataclass
class PointResult:
    """One configuration's answers. `columns` are per-request arrays aligned with the trace rows, named
    as in `kvbench.results.RESULT_SCHEMA` (hit_blocks, hit_tokens, evictions, ttft_s, …)."""

    labels: dict  # what identifies the point, e.g. {"policy": "lru", "capacity_blocks": 10000}
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # JSON-ready facts for the summary (matrices, flags, curves)

    @property
    def name(self) -> str:
        return "/".join(f"{v}" for v in self.labels.values())


class StreamedPoint(Protocol):
    """One configuration's answers to a streamed trace. The runner calls `answer` with every chunk of the
    trace in row order, then `finish` once."""

    labels: dict  # as in PointResult

    def answer(self, chunk: pa.RecordBatch) -> dict[str, np.ndarray]:
        """Per-request arrays for the chunk's rows, named as in `kvbench.results.RESULT_SCHEMA` (hit_blocks
        at least). `chunk` has block_hashes and the trace's `tracescan.REPLAY_COLUMNS`, cast to the schema."""
        ...

    def finish(self) -> dict:
        """The point's facts for the summary, after the last chunk: as `PointResult.extra` (an evict_matrix
        and its tenant_names become the metrics' fairness.evictor_victim)."""
        ...


class Backend(Protocol):
    name: ClassVar[str]

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        """Backend-specific `kvbench replay` options (each with help that states units)."""
        ...

    def config(self) -> dict:
        """The backend's settings as they go into summary.json (never secrets)."""
        ...

    def replay(self, trace: pa.Table, meta: TraceMeta) -> Iterator[PointResult]:
        """Answer every request of a validated trace, once per configuration point."""
        ...
