"""The one registration mechanism of kvbench: every pluggable catalogue (backends, generators, importers, exporters,
policies, engine-sim scenarios and routers, local engines) is a `Registry`, so no list is kept in sync by hand.

A registry collects its entries from up to three sources, on first read:

- decorators or `add` calls in the module that defines it (`package=None`: nothing to scan; the routers of
  engine-sim, the trace exporters);
- the public modules of a package, each registering itself when imported (`package="kvbench.trace.generators"`;
  modules named `_x` are helpers and are not imported);
- an entry-point group (`group="kvbench.backends"`): what installed distributions declare, so a third-party
  backend needs no edit here. Entry points are loaded one at a time, when their entry is first read, so listing
  the names imports no backend.

A registry reads like a read-only mapping of name to entry (`name in r`, `list(r)`, `r[name]`, `len(r)`),
sorted by name; `r.get(name)` raises KeyError with a message for the user (the choices) where a mapping's
would return None, while `r.get(name, default)` is the mapping's. Item assignment registers too, and deletion
removes (tests patch an entry with `monkeypatch.setitem`).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")
_MISSING: Any = object()


class EntryPoint(NamedTuple):
    """An entry point an installed distribution declares: `value` is "module:attribute" (extras ignored)."""

    name: str
    value: str

    def load(self) -> Any:
        """The object it names, its module imported (what importlib.metadata's EntryPoint.load does)."""
        module, _, attrs = self.value.partition("[")[0].partition(":")
        obj = importlib.import_module(module.strip())
        for attr in filter(None, attrs.strip().split(".")):
            obj = getattr(obj, attr)
        return obj


def entry_points(group: str) -> list[EntryPoint]:
    """The entry points of `group` that the distributions on sys.path declare in their entry_points.txt, the
    first distribution of a name on sys.path counting (as importlib.metadata finds them). Read here because
    importing importlib.metadata and letting it parse every distribution's metadata for its name took 40 ms of
    every command's start-up (a simulator's whole run on a small trace is 0.5 s); this lists the folders on
    sys.path and opens the entry_points.txt of each distribution in them (1 ms). A sys.path entry that is not a
    folder (a zip) is left to importlib.metadata."""
    if any(os.path.isfile(folder) for folder in sys.path if folder):
        from importlib.metadata import entry_points as from_metadata

        return [EntryPoint(ep.name, ep.value) for ep in from_metadata(group=group)]
    found, seen = [], set()
    for folder in sys.path:
        try:
            names = sorted(os.listdir(folder or "."))
        except OSError:
            continue
        for name in names:
            stem, dot, suffix = name.rpartition(".")
            if not dot or suffix not in ("dist-info", "egg-info"):
                continue
            dist = stem.partition("-")[0].lower().replace("-", "_").replace(".", "_")
            if dist in seen:
                continue
            seen.add(dist)
            try:
                with open(os.path.join(folder or ".", name, "entry_points.txt"), encoding="utf-8") as f:
                    found += _section(f.read(), group)
            except OSError:
                continue
    return found


def _section(text: str, group: str) -> list[EntryPoint]:
    """The `name = value` lines of the [group] section of an entry_points.txt (INI, comments with # or ;)."""
    out, inside = [], False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            inside = line[1:-1].strip() == group
        elif inside and line and line[0] not in "#;" and "=" in line:
            name, _, value = line.partition("=")
            out.append(EntryPoint(name.strip(), value.strip()))
    return out


class Registry(MutableMapping[str, T]):
    def __init__(self, package: str | None, what: str, *, group: str | None = None):
        self.package, self.what, self.group = package, what, group
        self._entries: dict[str, T] = {}
        self._points: dict[str, EntryPoint] = {}  # entry points not loaded yet
        self._scanned = False

    # -- registering

    def add(self, name: str, entry: T) -> None:
        self._points.pop(name, None)
        self._entries[name] = entry

    def add_lazy(self, name: str, value: str) -> None:
        """Register "module:attribute" under `name`, imported on the name's first read (as an entry point is)."""
        self._entries.pop(name, None)
        self._points[name] = EntryPoint(name, value)

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under `name` and returns it unchanged."""

        def wrap(entry: T) -> T:
            self.add(name, entry)
            return entry

        return wrap

    # -- reading

    def _scan(self) -> None:
        """Import each public module of the package and list the entry points of the group, once."""
        if self._scanned:
            return
        self._scanned = True
        if self.package is not None:
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                if not mod.name.startswith("_"):
                    importlib.import_module(f"{self.package}.{mod.name}")
        if self.group is not None:
            for ep in entry_points(group=self.group):
                if ep.name not in self._entries:
                    self._points.setdefault(ep.name, ep)

    def names(self) -> list[str]:
        self._scan()
        return sorted({*self._entries, *self._points})

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        self._scan()
        return name in self._entries or name in self._points

    def __getitem__(self, name: str) -> T:
        self._scan()
        if name in self._points:  # an entry point's first read loads it
            self._entries[name] = self._points.pop(name).load()
        if name not in self._entries:
            raise KeyError(f"unknown {self.what} {name!r}; choose one of: {', '.join(self.names())}")
        return self._entries[name]

    def __setitem__(self, name: str, entry: T) -> None:
        self._scan()  # so the scan, run later, does not overwrite what was set
        self.add(name, entry)

    def __delitem__(self, name: str) -> None:
        self._scan()
        if name in self._points:
            del self._points[name]
        else:
            del self._entries[name]

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The entry `name`; without a default, KeyError naming the choices when there is none."""
        if default is _MISSING:
            return self[name]
        return self[name] if name in self else default

    def all(self) -> dict[str, T]:
        """Every entry, by name (loading every entry point of the group)."""
        return {name: self[name] for name in self.names()}

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self.names())})"
