"""kvbench: trace-replay benchmark suite for the KV cache of LLM serving.

The Python API (`kvbench.api`) is reached from here: `kvbench.generate`, `kvbench.replay`, `kvbench.compare`,
… Nothing is imported until a name is first used, so `import kvbench` stays cheap (no pyarrow, polars, numba).
"""

__all__ = [
    "Grid",
    "KvbenchError",
    "Run",
    "Sweep",
    "Trace",
    "compare",
    "generate",
    "import_trace",
    "load_trace",
    "open_run",
    "replay",
    "sweep",
    "validate",
]

_FROM = {"Grid": "kvbench.run.sweeps", "KvbenchError": "kvbench.errors"}  # else kvbench.api


def __getattr__(name):
    import importlib

    if name == "__version__":
        value = _version()
    elif name in __all__:
        value = getattr(importlib.import_module(_FROM.get(name, "kvbench.api")), name)
    else:
        raise AttributeError(f"module 'kvbench' has no attribute {name!r}")
    globals()[name] = value
    return value


def _version() -> str:
    """The installed distribution's version, from the name of the first kvbench-VERSION.dist-info (or
    .egg-info) folder on sys.path, where importlib.metadata would find it: listing a few folders, where importing
    importlib.metadata costs ~35 ms of every command's start-up. importlib.metadata where the name is not
    plain (a folder named otherwise)."""
    import os
    import sys

    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            stem, _, suffix = name.rpartition(".")
            dist, _, version = stem.partition("-")
            if dist == "kvbench" and version and "-" not in version and suffix in ("dist-info", "egg-info"):
                return version
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvbench")
    except PackageNotFoundError:  # running from a source tree without installation
        return "0.0.0+unknown"


def __dir__():
    return sorted({*globals(), *__all__, "__version__"})
