"""Self-registering catalogues (generators, importers, later policies): modules of a package register
their entries when imported, so no list is kept in sync by hand."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, package: str, what: str):
        self.package, self.what = package, what
        self._entries: dict[str, T] = {}
        self._loaded = False

    def add(self, name: str, entry: T) -> None:
        self._entries[name] = entry

    def all(self) -> dict[str, T]:
        """Every entry, by name; imports each public module of the package once (`_name` modules are helpers)."""
        if not self._loaded:
            self._loaded = True
            pkg = importlib.import_module(self.package)
            for mod in pkgutil.iter_modules(pkg.__path__):
                if not mod.name.startswith("_"):
                    importlib.import_module(f"{self.package}.{mod.name}")
        return dict(sorted(self._entries.items()))

    def get(self, name: str) -> T:
        entries = self.all()
        if name not in entries:
            raise KeyError(f"unknown {self.what} {name!r}; choose one of: {', '.join(entries)}")
        return entries[name]
