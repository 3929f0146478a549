"""Seeded workload generators. Each module registers itself with `@generator`; nothing lists them by hand.

A generator is a function `(params, n, seed, block_size) -> pa.Table` plus a frozen dataclass of its
parameters. Every dataclass field carries `help` (and units) in its metadata; the CLI turns the fields into
options, so a new parameter shows up in `kvbench trace gen KIND --help` without further work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .. import __version__
from ..registry import Registry
from ..traceio import TraceMeta, new_meta

DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True)
class Generator:
    name: str
    params_type: type
    build: Callable[..., pa.Table]
    summary: str

    def run(
        self, n: int, seed: int = 0, block_size: int = DEFAULT_BLOCK_SIZE, **overrides
    ) -> tuple[pa.Table, TraceMeta]:
        if n <= 0:
            raise ValueError("the number of requests must be > 0")
        params = self.params_type(**overrides)
        table = self.build(params, n=n, seed=seed, block_size=block_size)
        source = {
            "generator": self.name,
            "n": n,
            "seed": seed,
            "params": dataclasses.asdict(params),
            # Random streams are numpy's: the same seed reproduces the trace with the same numpy release.
            "numpy": np.__version__,
            "kvbench": __version__,
        }
        return table, new_meta(block_size, source)


_REGISTRY: Registry[Generator] = Registry(__name__, "workload kind")


def generator(name: str, params_type: type):
    """Register a generator function under `name` with its parameter dataclass."""

    def wrap(fn):
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        _REGISTRY.add(name, Generator(name, params_type, fn, summary))
        return fn

    return wrap


registry = _REGISTRY.all
get = _REGISTRY.get


def param(default, help: str):
    """A generator parameter: a dataclass field whose `help` (with units) feeds the CLI."""
    return dataclasses.field(default=default, metadata={"help": help})
