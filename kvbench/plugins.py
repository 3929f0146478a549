"""Discovery of backends through the `kvbench.backends` entry-point group (no hand-kept list)."""

from __future__ import annotations

from importlib.metadata import entry_points

GROUP = "kvbench.backends"


def backend_names() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_backend(name: str):
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none installed"
        raise KeyError(f"unknown backend {name!r} (available: {known})")
    return eps[name].load()
