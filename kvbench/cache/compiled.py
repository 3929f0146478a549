"""Where the simulator's compiled kernels come from: an ahead-of-time (numba.pycc) extension module when one
was built for exactly these sources, numba's JIT (with its on-disk cache) otherwise.

Why: importing numba and initialising its CPU target costs ~2 s per process, four times the simulation of a
whole 8-capacity sweep on Mooncake. An extension module built once per user (in the background, the first
time a process has to JIT, as kvcache-simulator builds its C++ core on first use) loads in milliseconds and
needs no numba at all. Kernels are written once, as plain numba-compatible Python, under `@kernel_fn`:

- `@kernel_fn("sig")` marks an entry point called from Python; the pycc signature is exact, so its wrapper
  must pass exactly those dtypes (C-contiguous arrays, `[::1]`);
- `@kernel_fn()` marks a helper only called from kernels (numba compiles it into its callers).

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
_aot_module = None
_aot_tried = False
_build_started = False


class KernelFn:
    """A kernel whose compiled form is chosen on first call (see the module docstring)."""

    def __init__(self, py_func, signature):
        self.py_func = py_func
        self.signature = signature
        self.__name__ = py_func.__name__
        self.__doc__ = py_func.__doc__
        mod = py_func.__module__.removeprefix(_PKG + ".")
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
                impl = getattr(_load_aot(), self.export_name, None)
            if impl is None:
                _use_jit()
                impl = self.dispatcher()
                _start_background_build()
            self._impl = impl
        return self._impl

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
    Entry points stay wrappers (Python calls them; kernels never do), so each one still picks AOT or JIT."""
    seen = set()
    for k in list(_registry.values()):
        g = k.py_func.__globals__
        if id(g) in seen:
            continue
        seen.add(id(g))
        for name, value in list(g.items()):
            if isinstance(value, KernelFn) and value.signature is None:
                g[name] = value.dispatcher()


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


def module_name() -> str:
    """Name of the AOT module for these kernel sources, numba/numpy and this interpreter."""
    h = hashlib.sha256()
    for path in sorted(_PKG_DIR.rglob("*.py")):
        h.update(str(path.relative_to(_PKG_DIR)).encode())
        h.update(path.read_bytes())
    for part in (_dist_version("numba"), _dist_version("numpy"), sys.version, sysconfig.get_platform()):
        h.update(part.encode())
    return f"kvbench_kernels_{h.hexdigest()[:16]}"


def _ext_path(name: str) -> Path:
    return kernel_dir() / (name + sysconfig.get_config_var("EXT_SUFFIX"))


def _load_aot():
    global _aot_module, _aot_tried
    if not _aot_tried:
        _aot_tried = True
        name = module_name()
        path = _ext_path(name)
        if path.exists():
            try:
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                _aot_module = mod
            except Exception:  # a broken or foreign file: JIT instead (the build replaces it)
                _aot_module = None
    return _aot_module


# --- building -----------------------------------------------------------------------------------------


def _lock_path(name: str) -> Path:
    return kernel_dir() / (name + ".lock")


def _failed_path(name: str) -> Path:
    return kernel_dir() / (name + ".failed")


def _start_background_build() -> None:
    """Once per process, and only when no AOT module, build or failed build exists for these sources."""
    global _build_started
    if _build_started or not _aot_enabled():
        return
    _build_started = True
    try:
        name = module_name()
        if _ext_path(name).exists() or _failed_path(name).exists() or _lock_is_fresh(name):
            return
        subprocess.Popen(
            [sys.executable, "-m", f"{_PKG}.compiled", "build"],
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


def build(wait: bool = True, timeout_s: float = 600) -> Path | None:
    """Build the AOT module for the current sources (no-op if it exists) and return its path; None when it
    cannot be built (no C compiler...). If another process is building it, wait for that build (`wait`)."""
    name = module_name()
    target = _ext_path(name)
    kernel_dir().mkdir(parents=True, exist_ok=True)
    deadline = time.time() + timeout_s
    while not target.exists():
        if _take_lock(name):
            try:
                _compile(name, target)
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


def _compile(name: str, target: Path) -> None:
    import importlib
    import warnings

    for path in sorted(_PKG_DIR.rglob("*.py")):  # importing every module registers every kernel
        parts = path.relative_to(_PKG_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        importlib.import_module(".".join((_PKG, *parts)))
    _use_jit()  # the exported functions' helpers must be dispatchers for pycc too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba.pycc's pending-deprecation warning
        from numba.pycc import CC

        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            cc = CC(name)
            cc.output_dir = tmp
            cc.verbose = False
            for k in _registry.values():
                if k.signature is not None:
                    cc.export(k.export_name, k.signature)(k.py_func)
            cc.compile()
            built = Path(tmp) / target.name
            os.replace(built, target)  # atomic: a reader sees no module or a whole one


if __name__ == "__main__":
    # run as `python -m`: this file is then `__main__`, not the package module holding the registry
    import importlib

    compiled = importlib.import_module(f"{_PKG}.compiled")
    if sys.argv[1:] == ["build"]:
        sys.exit(0 if compiled.build() is not None else 1)
    print(f"usage: python -m {_PKG}.compiled build", file=sys.stderr)
    sys.exit(2)
