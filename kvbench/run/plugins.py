"""Discovery of backends: a `Registry` over the `kvbench.backends` entry-point group, so the built-in backends
and third-party ones are found the same way (no hand-kept list). Listing the names imports no backend; a
backend's module is imported when it is first loaded."""

from __future__ import annotations

from kvbench.registry import Registry
from kvbench.run.backend import protocol_of

GROUP = "kvbench.backends"
BACKENDS: Registry[type] = Registry(None, "backend", group=GROUP)


def backend_names() -> list[str]:
    return BACKENDS.names()


def load_backend(name: str):
    """The backend class registered as `name`. KeyError (its message for the user) when no such backend is
    installed, or when what the entry point names implements none of the protocols of `kvbench.run.backend`."""
    if name not in BACKENDS:
        known = ", ".join(BACKENDS.names()) or "none installed"
        raise KeyError(f"unknown backend {name!r} (available: {known})")
    cls = BACKENDS[name]
    try:
        protocol_of(cls, name)
    except TypeError as exc:
        raise KeyError(str(exc)) from None
    return cls
