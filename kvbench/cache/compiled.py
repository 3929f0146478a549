"""Where the simulator's compiled kernels come from: an ahead-of-time (numba.pycc) extension module when one
was built for exactly these sources, numba's JIT (with its on-disk cache) otherwise.

Why: importing numba and initialising its CPU target costs ~2 s per process, four times the simulation of a
whole 8-capacity sweep on Mooncake. An extension module built once per user (in the background, the first
time a process has to JIT, as kvcache-simulator builds its C++ core on first use) loads in milliseconds and
needs no numba at all. Kernels are written once, as plain numba-compatible Python, under `@kernel_fn`:

- `@kernel_fn("sig")` marks an entry point called from Python; the pycc signature is exact, so its wrapper
  must pass exactly those dtypes (C-contiguous arrays, `[::1]`);
- `@kernel_fn()` marks a helper only called from kernels (numba compiles it into its callers).

Kernels are grouped in units, one AOT module each, named after a hash of the unit's sources: `kvbench.cache`
(the simulator's) for every module under it, otherwise the kernel module's own package (a backend's, e.g.
kvbench.backends.enginesim), so a backend brings its kernels without touching the core's module.

Nothing here imports numba until a kernel has to be JIT-compiled or the AOT module built.

Environment: KVBENCH_KERNEL_DIR (where AOT modules live; default $XDG_CACHE_HOME/kvbench or ~/.cache/kvbench),
KVBENCH_NO_AOT=1 (neither use nor build AOT modules: always JIT).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

_PKG_DIR = Path(__file__).resolve().parent
_PKG = __package__  # kvbench.cache (also when run with `python -m`)
_LOCK_STALE_S = 900  # a build lock older than this is from a build that died

_registry: dict[str, KernelFn] = {}  # export name -> kernel, in registration order
_aot_modules: dict[str, object] = {}  # unit -> its loaded AOT module, or None (tried, none usable)
_builds_started: set[str] = set()


def unit_of(module: str) -> str:
    """The AOT unit of a kernel defined in `module` (see the module docstring)."""
    if module == _PKG or module.startswith(_PKG + "."):
        return _PKG
    return module.rpartition(".")[0]


def _unit_dir(unit: str) -> Path:
    if unit == _PKG:
        return _PKG_DIR
    return Path(importlib.util.find_spec(unit).submodule_search_locations[0])


class KernelFn:
    """A kernel whose compiled form is chosen on first call (see the module docstring)."""

    def __init__(self, py_func, signature):
        self.py_func = py_func
        self.signature = signature
        self.__name__ = py_func.__name__
        self.__doc__ = py_func.__doc__
        self.unit = unit_of(py_func.__module__)
        mod = py_func.__module__.removeprefix(self.unit + ".")
        self.export_name = f"{mod.replace('.', '_')}__{py_func.__name__}"
        self._dispatcher = None
        self._impl = None

    def dispatcher(self):
        if self._dispatcher is None:
            from numba import njit

            self._dispatcher = njit(cache=True)(self.py_func)
        return self._dispatcher

    def resolve(self):
        if self._impl is None:
            impl = None
            if self.signature is not None and _aot_enabled():
                impl = getattr(_load_aot(self.unit), self.export_name, None)
            if impl is None:
                _use_jit()
                impl = self.dispatcher()
                start_background_build(self.unit)
            self._impl = impl
        return self._impl

    def aot_ready(self) -> bool:
        """Whether this entry point would run from an AOT module now (no numba import, no compile)."""
        return self.signature is not None and _aot_enabled() and hasattr(_load_aot(self.unit), self.export_name)

    def __call__(self, *args):
        return self.resolve()(*args)

    def __repr__(self):
        return f"<kernel {self.export_name}>"


def kernel_fn(signature: str | None = None):
    """Decorator for a kernel (with the pycc signature of an entry point) or a kernel helper (no signature)."""

    def wrap(py_func):
        k = KernelFn(py_func, signature)
        _registry[k.export_name] = k
        return k

    return wrap


# pycc return type of every policy kernel: hit_blocks, evictions, evict_matrix, filled_at (SimOutput)
SIM_OUT = "Tuple((i4[::1], i4[::1], i8[:, ::1], i8))"

# AOT entry points take exactly their signature's dtypes (a pycc wrapper does not convert), so wrappers pass
# arrays through these: no copy when the array already is C-contiguous of that dtype.


def i4(a):
    return np.ascontiguousarray(a, dtype=np.int32)


def i8(a):
    return np.ascontiguousarray(a, dtype=np.int64)


def _use_jit() -> None:
    """Point every kernel module's globals at numba dispatchers for the helpers, so that kernels calling them
    (also across modules: tenant_quota uses trie.py's heaps) compile against dispatchers, not these wrappers.
    Entry points stay wrappers (Python calls them; kernels never do), so each one still picks AOT or JIT.
    A module's `NUMBA_GLOBALS` (name -> "module:attribute", e.g. numba's typed List) are bound here too: kernels
    may use them, and a process that runs AOT kernels only never imports numba for them."""
    seen = set()
    for k in list(_registry.values()):
        g = k.py_func.__globals__
        if id(g) in seen:
            continue
        seen.add(id(g))
        for name, value in list(g.items()):
            if isinstance(value, KernelFn) and value.signature is None:
                g[name] = value.dispatcher()
        for name, where in g.get("NUMBA_GLOBALS", {}).items():
            module, _, attr = where.partition(":")
            g[name] = getattr(importlib.import_module(module), attr)


# --- the AOT module: name, location, loading -------------------------------------------------------------


def _aot_enabled() -> bool:
    return os.environ.get("KVBENCH_NO_AOT", "") in ("", "0")


def kernel_dir() -> Path:
    if d := os.environ.get("KVBENCH_KERNEL_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbench"


def _dist_version(name: str) -> str:
    # reading the dist-info directory name is ~100x cheaper than importlib.metadata (which costs ~40 ms)
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
        site = Path(spec.origin).parent.parent
        found = sorted(p.name for p in site.glob(f"{name}-*.dist-info"))
        if found:
            return found[-1]
    from importlib.metadata import version

    return version(name)


def module_name(unit: str = _PKG) -> str:
    """Name of the AOT module for a unit's kernel sources, numba/numpy and this interpreter."""
    h = hashlib.sha256()
    root = _unit_dir(unit)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for part in (_dist_version("numba"), _dist_version("numpy"), sys.version, sysconfig.get_platform(), _host_cpu()):
        h.update(part.encode())
    prefix = "kvbench" if unit == _PKG else unit.replace(".", "_")
    return f"{prefix}_kernels_{h.hexdigest()[:16]}"


def _host_cpu() -> str:
    """What the AOT module is built for (it targets the host CPU, as the JIT does: generic x86-64 code ran the
    lru kernel ~1.4x slower here). A home folder shared by machines of different CPUs (a Ray cluster on NFS)
    then holds one module per CPU, never one that would stop on an instruction this CPU lacks. Read from
    /proc/cpuinfo, not LLVM, which would cost its import at every start."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read(1 << 16).split("\n\n", 1)[0]  # the first processor's block
        return "\n".join(line for line in first.splitlines() if line.startswith(("vendor_id", "model name", "flags")))
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def _ext_path(name: str) -> Path:
    return kernel_dir() / (name + sysconfig.get_config_var("EXT_SUFFIX"))


def _load_aot(unit: str = _PKG):
    if unit not in _aot_modules:
        _aot_modules[unit] = None
        name = module_name(unit)
        path = _ext_path(name)
        if path.exists():
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                _aot_modules[unit] = mod
            except Exception:  # a broken or foreign file: JIT instead (the build replaces it)
                pass
    return _aot_modules[unit]


# --- building -----------------------------------------------------------------------------------------


def _lock_path(name: str) -> Path:
    return kernel_dir() / (name + ".lock")


def _failed_path(name: str) -> Path:
    return kernel_dir() / (name + ".failed")


def start_background_build(unit: str = _PKG) -> None:
    """Once per process and unit, and only when no AOT module, build or failed build exists for its sources."""
    if unit in _builds_started or not _aot_enabled():
        return
    _builds_started.add(unit)
    try:
        name = module_name(unit)
        if _ext_path(name).exists() or _failed_path(name).exists() or _lock_is_fresh(name):
            return
        subprocess.Popen(
            [sys.executable, "-m", f"{_PKG}.compiled", "build", unit],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # detached: outlives this process, never gets its signals
            close_fds=True,
        )
    except Exception:
        pass  # the AOT module is an optimisation: never fail a run for it


def _lock_is_fresh(name: str) -> bool:
    try:
        return time.time() - _lock_path(name).stat().st_mtime < _LOCK_STALE_S
    except FileNotFoundError:
        return False


def _take_lock(name: str) -> bool:
    lock = _lock_path(name)
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if _lock_is_fresh(name):
                return False
            lock.unlink(missing_ok=True)  # left by a build that died
    return False


def build(wait: bool = True, timeout_s: float = 600, unit: str = _PKG) -> Path | None:
    """Build a unit's AOT module for the current sources (no-op if it exists) and return its path; None when
    it cannot be built (no C compiler...). If another process is building it, wait for that build (`wait`)."""
    name = module_name(unit)
    target = _ext_path(name)
    kernel_dir().mkdir(parents=True, exist_ok=True)
    deadline = time.time() + timeout_s
    while not target.exists():
        if _take_lock(name):
            try:
                _compile(unit, name, target)
                _failed_path(name).unlink(missing_ok=True)  # an explicit build retries what a background one failed
            except Exception as e:
                _failed_path(name).write_text(f"{type(e).__name__}: {e}\n")
                return None
            finally:
                _lock_path(name).unlink(missing_ok=True)
            break
        if not wait or time.time() > deadline:
            return None
        time.sleep(0.2)
        if _failed_path(name).exists():
            return None
    return target


def _compile(unit: str, name: str, target: Path) -> None:
    import importlib
    import warnings

    root = _unit_dir(unit)
    for path in sorted(root.rglob("*.py")):  # importing every module registers every kernel
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        importlib.import_module(".".join((unit, *parts)))
    _use_jit()  # the exported functions' helpers must be dispatchers for pycc too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba.pycc's pending-deprecation warning
        from numba.pycc import CC

        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            cc = CC(name)
            cc.target_cpu = "host"  # see _host_cpu
            cc.output_dir = tmp
            cc.verbose = False
            for k in _registry.values():
                if k.signature is not None and k.unit == unit:
                    cc.export(k.export_name, k.signature)(k.py_func)
            cc.compile()
            built = Path(tmp) / target.name
            os.replace(built, target)  # atomic: a reader sees no module or a whole one


if __name__ == "__main__":
    # run as `python -m`: this file is then `__main__`, not the package module holding the registry
    import importlib

    compiled = importlib.import_module(f"{_PKG}.compiled")
    if sys.argv[1:2] == ["build"] and len(sys.argv) <= 3:
        sys.exit(0 if compiled.build(unit=sys.argv[2] if len(sys.argv) == 3 else _PKG) is not None else 1)
    print(f"usage: python -m {_PKG}.compiled build [UNIT, default {_PKG}]", file=sys.stderr)
    sys.exit(2)
