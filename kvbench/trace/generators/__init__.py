"""Seeded workload generators. Each module registers itself with `@generator`; nothing lists them by hand.

A generator is a function `(params, n, seed, block_size) -> pa.Table` plus a frozen dataclass of its
parameters. Every dataclass field is a `param`, an `options.option` field (help, unit) with bounds; the CLI
turns the fields into options (`options.cli_options`), so a new parameter shows up in `kvbench trace gen KIND
--help` without further work.

A *streamed* generator (`@generator(..., streamed=True)`: chat, reasoning) is instead a function
`(params, n, seed, block_size, window_requests) -> Iterator[pa.Table]` yielding the trace in arrival
order, window by window (`_stream.py`); `Generator.write` then writes a trace of any length in bounded
memory, with exactly the rows of the whole-table path. The others build the whole table in memory, and
`write` refuses a request count that would not fit (`InMemoryLimit`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench import __version__, options
from kvbench.errors import KvbenchError
from kvbench.registry import Registry
from kvbench.trace.files import ROW_GROUP_SIZE, TraceMeta, new_meta
from kvbench.trace.generators._stream import WINDOW_REQUESTS
from kvbench.trace.writer import TraceWriter

DEFAULT_BLOCK_SIZE = 64
# Peak memory of an in-memory generator per request, unless it registers its own: what `write` checks
# against the memory free. Measured (peak RSS / requests, 300,000 requests): agent 17.6 KB (~40K-token
# prompts), mix 7.5 KB, multi-tenant 6.4 KB, multimodal 3.8 KB.
IN_MEMORY_BYTES_PER_REQUEST = 20_000


class BadParameter(KvbenchError, ValueError):
    """A generator parameter out of its range (a ValueError too, as Python callers expect of a bad value)."""


class InMemoryLimit(KvbenchError):
    """A generator that builds the whole trace in memory was asked for more requests than fit."""


def _available_memory() -> int | None:
    """Memory the system can give without swapping (Linux MemAvailable: free plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # neither: no check
        return None


@dataclass(frozen=True)
class Generator:
    name: str
    params_type: type
    build: Callable[..., pa.Table]
    summary: str
    stream: Callable[..., Iterator[pa.Table]] | None = None  # streamed generators only
    bytes_per_request: int = IN_MEMORY_BYTES_PER_REQUEST  # peak memory of `run` per request (in-memory kinds)

    def run(
        self, n: int, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE, **overrides
    ) -> tuple[pa.Table, TraceMeta]:
        """The whole trace as one table (in memory)."""
        params = self._params(n, overrides)
        return self.build(params, n=n, seed=seed, block_size=block_size), self._meta(params, n, seed, block_size)

    def write(
        self,
        out: str | Path,
        n: int,
        seed: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        window_requests: int = WINDOW_REQUESTS,
        row_group_size: int = ROW_GROUP_SIZE,
        **overrides,
    ) -> int:
        """Generate and write a validated trace file; returns its row count. A streamed generator writes it
        `window_requests` requests at a time (the same trace as `run`); the others build it in memory, and
        raise InMemoryLimit when `n` requests would need more than the memory free now."""
        params = self._params(n, overrides)
        meta = self._meta(params, n, seed, block_size)
        with TraceWriter(out, meta, row_group_size=row_group_size) as writer:
            if self.stream is not None:
                for chunk in self.stream(params, n, seed, block_size, window_requests=window_requests):
                    writer.write(chunk)
            else:
                self._check_fits(n)
                writer.write(self.build(params, n=n, seed=seed, block_size=block_size))
        return writer.rows

    def _check_fits(self, n: int) -> None:
        need, free = n * self.bytes_per_request, _available_memory()
        if free is not None and need > free:
            streamed = ", ".join(k for k, g in registry().items() if g.stream is not None)
            raise InMemoryLimit(
                f"{self.name} builds the whole trace in memory (~{self.bytes_per_request / 1000:.0f} KB a request): "
                f"{n:,} requests need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is free. Generate at most "
                f"{free // self.bytes_per_request:,} requests, or use a kind that streams ({streamed})"
            )

    def _params(self, n: int, overrides: dict):
        if n <= 0:
            raise BadParameter(f"-n {n}: the number of requests must be > 0")
        params = self.params_type(**overrides)
        check_params(params)
        return params

    def _meta(self, params, n: int, seed: int, block_size: int) -> TraceMeta:
        source = {
            "generator": self.name,
            "n": n,
            "seed": seed,
            "params": dataclasses.asdict(params),
            # Random streams are numpy's: the same seed reproduces the trace with the same numpy release.
            "numpy": np.__version__,
            "kvbench": __version__,
        }
        return new_meta(block_size, source)


_REGISTRY: Registry[Generator] = Registry(__name__, "workload kind")


def generator(name: str, params_type: type, streamed: bool = False, bytes_per_request: int | None = None):
    """Register a generator function under `name` with its parameter dataclass; `streamed`: the function
    yields the trace in arrival order, window by window (see the module docstring); `bytes_per_request`:
    the peak memory of an in-memory kind per request (default IN_MEMORY_BYTES_PER_REQUEST)."""
    extra = {} if bytes_per_request is None else {"bytes_per_request": bytes_per_request}

    def wrap(fn):
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        if streamed:

            def build(params, n, seed, block_size):
                return pa.concat_tables(list(fn(params, n, seed, block_size, window_requests=None)))

            _REGISTRY.add(name, Generator(name, params_type, build, summary, stream=fn, **extra))
        else:
            _REGISTRY.add(name, Generator(name, params_type, fn, summary, **extra))
        return fn

    return wrap


registry = _REGISTRY.all
get = _REGISTRY.get


def param(default, help: str, *, unit: str, flag=None, at_least=None, above=None, at_most=None, below=None):
    """A generator parameter: an `options.option` field (its help and unit feed the CLI; a bool's `flag` is
    its --NAME/--no-NAME switch) with bounds. A number must be finite and within them (by default >= 0: no
    parameter is a negative count, rate, length or time); `check_params` refuses one outside them, naming the
    option, before anything is drawn."""
    if at_least is None and above is None:
        at_least = 0
    bounds = options.Bounds(at_least=at_least, above=above, at_most=at_most, below=below)
    return options.option(default, help, unit=unit, flag=flag, bounds=bounds)


def check_params(params) -> None:
    """Every numeric parameter finite and within its `param` bounds, else a KvbenchError naming the option as
    `kvbench trace gen` spells it."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        option = "--" + f.name.replace("_", "-")
        if not math.isfinite(value):
            raise BadParameter(f"{option} {value!r} must be a finite number ({options.help_of(f)})")
        bounds = getattr(f.metadata.get("option"), "bounds", None)
        broken = bounds and bounds.broken(value)
        if broken:
            raise BadParameter(f"{option} {value!r} must be {broken} ({options.help_of(f)})")
