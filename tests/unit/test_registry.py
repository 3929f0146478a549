"""kvbench.registry.Registry, the one registration mechanism: entries by decorator in one module, by the public
modules of a package, and by an entry-point group (loaded lazily); read as a mapping."""

import subprocess
import sys

import pytest

from kvbench.registry import Registry


def test_a_module_registry_reads_as_a_sorted_mapping():
    things: Registry[int] = Registry(None, "thing")

    @things.register("b")
    def b():
        return 2

    things.add("a", 1)
    assert b() == 2  # the decorator hands back what it decorates
    assert list(things) == ["a", "b"] and len(things) == 2 and "a" in things and "c" not in things
    assert things["a"] == 1 and things.get("c", None) is None and dict(things) == {"a": 1, "b": b}
    with pytest.raises(KeyError, match="unknown thing 'c'; choose one of: a, b"):
        things.get("c")
    with pytest.raises(KeyError, match="unknown thing 'c'"):
        things["c"]


def test_item_assignment_registers_so_tests_can_patch_an_entry(monkeypatch):
    things: Registry[int] = Registry(None, "thing")
    things.add("a", 1)
    with monkeypatch.context() as m:
        m.setitem(things, "a", 10)
        m.setitem(things, "z", 26)
        assert dict(things) == {"a": 10, "z": 26}
    assert dict(things) == {"a": 1}


def test_a_package_registry_imports_the_public_modules_once():
    from kvbench.trace import generators

    kinds = generators.registry()
    assert {"chat", "agent"} <= set(kinds)
    assert not any(name.startswith("_") for name in kinds)


def test_an_entry_point_registry_lists_names_without_loading_them():
    code = (
        "import sys; from kvbench.run import plugins;"
        "names = plugins.backend_names();"
        "print('sim' in names, 'torch' in names, any(m.startswith('kvbench.backends.') for m in sys.modules));"
        "plugins.load_backend('sim'); print('kvbench.backends.sim' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "False", "True"]
