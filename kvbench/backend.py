"""The Backend protocol: the narrow interface between the replay runner (core) and every backend.

The runner owns reading and validating the trace, pacing, collecting results and writing the run
directory; a backend only answers requests. Backends are plug-ins found through the `kvbench.backends`
entry-point group (`kvbench.plugins`), never imported by the core.

An *offline* backend (the simulators) answers a whole trace at once, in arrival order, for each of its
configuration points (e.g. policy x capacity), yielding one `PointResult` per point as soon as it is done,
so the runner can write it before the next one starts.
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
class PointResult:
    """One configuration's answers. `columns` are per-request arrays aligned with the trace rows, named
    as in `kvbench.results.RESULT_SCHEMA` (hit_blocks, hit_tokens, evictions, ttft_s, …)."""

    labels: dict  # what identifies the point, e.g. {"policy": "lru", "capacity_blocks": 10000}
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # JSON-ready facts for the summary (matrices, flags, curves)

    @property
    def name(self) -> str:
        return "/".join(f"{v}" for v in self.labels.values())


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
