"""Discovery of backends through the `kvbench.backends` entry-point group (no hand-kept list)."""

from __future__ import annotations

from importlib.metadata import entry_points

from kvbench.run.backend import protocol_of

GROUP = "kvbench.backends"


def backend_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_backend(name: str):
    """The backend class registered as `name`. KeyError (its message for the user) when no such backend is
    installed, or when what the entry point names implements none of the protocols of `kvbench.run.backend`."""
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise KeyError(f"unknown backend {name!r} (available: {known})")
    cls = eps[name].load()
    try:
        protocol_of(cls, name)
    except TypeError as exc:
        raise KeyError(str(exc)) from None
    return cls
