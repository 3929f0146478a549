"""kvbench: trace-replay benchmark suite for the KV cache of LLM serving.

The Python API (`kvbench.api`) is reached from here: `kvbench.generate`, `kvbench.replay`, `kvbench.compare`,
… Nothing is imported until a name is first used, so `import kvbench` stays cheap (no pyarrow, polars, numba).

`compare`, `sweep` and `validate` are also modules of this package (kvbench/compare.py, …), and Python binds a
submodule to the package attribute of its name once anything imports it. So those three modules are made
callable: `kvbench.sweep(...)` calls `kvbench.api.sweep`, while `from kvbench import sweep` and
`kvbench.sweep.run_sweep` still give the module and its contents, whichever is imported first.
"""

import sys
import types

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

_FROM = {"Grid": "kvbench.sweep", "KvbenchError": "kvbench.errors"}  # else kvbench.api
_CALLABLE_MODULES = ("compare", "sweep", "validate")


class _CallableModule(types.ModuleType):
    """A submodule that shares its name with an API function: calling it calls the function."""

    def __call__(self, *args, **kwargs):
        return getattr(_api(), self.__name__.rpartition(".")[2])(*args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(getattr(_api(), self.__name__.rpartition(".")[2]))


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # the import system binds a submodule here when it is first imported, by whatever path
        if name in _CALLABLE_MODULES and type(value) is types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


def _api():
    import importlib

    return importlib.import_module("kvbench.api")


def __getattr__(name):
    import importlib

    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("kvbench")
        except PackageNotFoundError:  # running from a source tree without installation
            value = "0.0.0+unknown"
    elif name in _CALLABLE_MODULES:
        return importlib.import_module(f"kvbench.{name}")  # bound here by the import, made callable
    elif name in __all__:
        value = getattr(importlib.import_module(_FROM.get(name, "kvbench.api")), name)
    else:
        raise AttributeError(f"module 'kvbench' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__, "__version__"})


sys.modules[__name__].__class__ = _Package
