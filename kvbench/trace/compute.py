"""Arrow's compute functions, without importing pyarrow.compute where a replay does not need it.

Importing pyarrow.compute builds a Python wrapper with a docstring for each of Arrow's ~300 functions: 70 ms,
a seventh of a simulator run that loads its trace from the trace cache, which calls three of them (on the
tenant and workload labels). So kvbench's modules take `pc` from here, a stand-in that imports
pyarrow.compute on first use, and the paths every replay runs call those three through
`pyarrow._compute.call_function`, the same kernels with the same options as pyarrow.compute's wrappers (the
extension module behind them imports in 18 ms). Arrow's own methods that compute (`.cast`, `.fill_null`,
`.dictionary_encode`) import pyarrow.compute too, which is why they are not used on those paths.
"""

from __future__ import annotations

import importlib

import pyarrow as pa


class _OnFirstUse:
    """pyarrow.compute, imported when an attribute is first read; each one read is kept."""

    def __getattr__(self, name: str):
        value = getattr(importlib.import_module("pyarrow.compute"), name)
        setattr(self, name, value)
        return value


pc = _OnFirstUse()


def _kernels():
    """The extension module behind pyarrow.compute (which re-exports its call_function and CastOptions), or
    pyarrow.compute itself for a pyarrow that moved it."""
    try:
        import pyarrow._compute as kernels
    except ImportError:
        kernels = importlib.import_module("pyarrow.compute")
    return kernels


def _call(name: str, args: list, options=None):
    return _kernels().call_function(name, args, options)


def call(name: str, *args):
    """Arrow compute function `name` with its default options, e.g. call("list_flatten", hashes) for
    pc.list_flatten(hashes): for the functions a first run's validation needs (`kvbench.trace.validation`)."""
    return _call(name, list(args))


def index_in(values, value_set: pa.Array) -> pa.Array | pa.ChunkedArray:
    """pyarrow.compute.index_in(values, value_set=value_set): each value's first position in the set, null
    where it is absent."""
    return _call("index_in", [values], _kernels().SetLookupOptions(value_set))


def cast(values: pa.Array | pa.ChunkedArray, to: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """`values.cast(to)` (a safe cast)."""
    if values.type == to:
        return values
    return _call("cast", [values], _kernels().CastOptions.safe(to))


def to_text(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Dictionary-encoded labels as plain strings (others unchanged): `values.cast(pa.string())`."""
    if not pa.types.is_dictionary(values.type):
        return values
    return _call("cast", [values], _kernels().CastOptions.safe(pa.string()))


def fill_null(values: pa.Array | pa.ChunkedArray, fill: str | int | float) -> pa.Array | pa.ChunkedArray:
    """`values` with each null replaced by `fill` (pyarrow.compute.fill_null: coalesce with a scalar)."""
    return _call("coalesce", [values, pa.scalar(fill, type=values.type)])


def dictionary_encode(values: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray | pa.ChunkedArray:
    """pyarrow.compute.dictionary_encode with its default options (a null stays a null)."""
    return _call("dictionary_encode", [values])
