"""Packaging: the console script, the wheel, loading without the extras, and the backend plug-in group
(docs/architecture.md, Layers)."""

import shutil
import subprocess
import sys
import tomllib

from kvbench.run import plugins

from ..conftest import REPO


def test_the_console_script_runs(tmp_path):
    """The installed `kvbench` script reaches the CLI (its entry point names a callable that exists)."""
    script = shutil.which("kvbench")
    assert script, "no kvbench console script on PATH: the package is not installed"
    out = subprocess.run([script, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Usage: kvbench" in out.stdout


def test_backends_are_namespaced_and_found_through_entry_points(tmp_path):
    # Run outside the source tree so that only what pip installed is importable.
    code = (
        "import importlib.util, kvbench.backends, kvbench.run.plugins as p;"
        "print(importlib.util.find_spec('backends') is None, kvbench.backends.__name__, p.backend_names())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    top_level_absent, name, names = out.stdout.split(" ", 2)
    assert top_level_absent == "True" and name == "kvbench.backends"
    assert sorted(eval(names)) == plugins.backend_names()


def test_unknown_backend_error_names_the_available_ones():
    import pytest

    with pytest.raises(KeyError, match="unknown backend 'nope'"):
        plugins.load_backend("nope")


def test_the_wheel_holds_every_module(tmp_path):
    """Users install the wheel, not the checkout: an editable install hides a package the build leaves out (the
    engine-sim scenarios once were), so build one and compare it with the source trees."""
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(REPO),
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvbench-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    sources = {f"kvbench/{p.relative_to(REPO / 'kvbench').as_posix()}" for p in (REPO / "kvbench").rglob("*.py")}
    sources |= {
        f"kvbench/backends/{p.relative_to(REPO / 'backends').as_posix()}" for p in (REPO / "backends").rglob("*.py")
    }
    assert sources - shipped == set()


def test_the_cli_and_every_backend_load_without_the_extras(tmp_path):
    """`pip install kvbench` installs no extra, and `kvbench demo` must run there (.ci/check-wheel does, from the
    wheel): the CLI and every backend's entry point load with the extras' modules (aiohttp, orjson, torch, ray,
    ...) unimportable. A backend imports them where it uses them, not when it is loaded."""
    import re

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    blocked = sorted(
        {
            re.split(r"[<>=!~\[; ]", req)[0].lower().replace("-", "_")
            for x in ("torch", "live", "ray")
            for req in extras[x]
        }
    )
    code = f"""
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: an extra)", name=name)
sys.meta_path.insert(0, Block())
import kvbench.cli
from kvbench.run import plugins
from kvbench.cli.demo_run import demo_backends
for name in plugins.backend_names():
    plugins.load_backend(name)
print(demo_backends())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sim" in out.stdout
