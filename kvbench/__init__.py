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
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("kvbench")
        except PackageNotFoundError:  # running from a source tree without installation
            value = "0.0.0+unknown"
    elif name in __all__:
        value = getattr(importlib.import_module(_FROM.get(name, "kvbench.api")), name)
    else:
        raise AttributeError(f"module 'kvbench' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__, "__version__"})
