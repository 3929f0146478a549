"""What preparing a trace for a simulator computes, kept on disk and loaded on the next run of the same file.

Before its first kernel a simulator run reads the whole Parquet trace, validates it, fingerprints it, resolves
the infinite cache and numbers its block ids densely (`kvbench.cache.prepared.prepare`): tens of milliseconds
and a good share of the imports for a trace whose kernels take one or two. All of it is a pure function of
the file's bytes and of a few options, so it is stored once per file (docs/architecture.md, Trace cache):

    $KVBENCH_CACHE_DIR (default $XDG_CACHE_HOME/kvbench/prepared, else ~/.cache/kvbench/prepared)
      <key>/trace/           the validated trace: trace.json (fingerprint, counts, metadata), arrays.bin (blocks
                             and infinite-cache hits per request) and requests.arrow (every column but
                             block_hashes, Arrow IPC)
      <key>/prepared-<opts>/ one `PreparedTrace` per preparing option set (salt folded, LoRA shared, vLLM's cap):
                             arrays.bin (its arrays, loaded memory-mapped) and prepared.json (their layout)

The key is a hash of the file's identity as the filesystem gives it (absolute path with links not resolved,
device, inode, size, mtime and ctime in ns), of the cache format and of the preparing code (`code_stamp`): one
`fstat`, no read of the trace, where its content fingerprint would cost a pass over every block id. The
ctime catches what an mtime alone misses (`touch -d`, `cp -p`, rsync restoring an older time, which all set
the ctime to now); the Parquet footer's hash, stored in the entry and compared on load (one read of a few KB),
catches a rewrite of the same size within one timestamp tick. The content fingerprint is stored in the entry
for summary.json, as the uncached run computes it.

Each part is written under a temporary name, fsynced and renamed into place, so a killed run never leaves a
part that a later run trusts; a part that does not load (truncated, foreign, another format) is rebuilt with
a one-line note; a cache folder that cannot be written (read-only, full) means no caching, never an error.
Nothing is ever removed: delete the folder to clear the cache.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

from kvbench import __version__
from kvbench.errors import KvbenchWarning
from kvbench.trace.files import TraceMeta

CACHE_FORMAT = 1  # of the files below: a change that old entries cannot be read as changes the key
CACHE_DIR_ENV = "KVBENCH_CACHE_DIR"
TRACE_PART = "trace"
_PACKAGE = Path(__file__).resolve().parents[1]  # kvbench/
_PREPARING_CODE = ("trace", "cache")  # kvbench/trace/*.py and kvbench/cache/*.py compute what is cached
_QUIET_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}  # a cache folder one may not write: no caching, silently


def cache_root() -> Path:
    """Where entries live: $KVBENCH_CACHE_DIR, else $XDG_CACHE_HOME/kvbench/prepared, else ~/.cache/..."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvbench" / "prepared"


@functools.cache  # (once a process: a sweep's points, an in-process benchmark, open many entries)
def code_stamp() -> str:
    """The preparing code's version: kvbench's, and every module of kvbench/trace and kvbench/cache by name,
    size and mtime (a stat each). A released kvbench changes only with its version; a source checkout changes
    with an edit, and must not load what the code before the edit prepared."""
    h = hashlib.blake2b(f"{CACHE_FORMAT}:{__version__}".encode(), digest_size=16)
    for folder in _PREPARING_CODE:
        for entry in sorted(os.scandir(_PACKAGE / folder), key=lambda e: e.name):
            if entry.name.endswith(".py"):
                st = entry.stat()
                h.update(f"{folder}/{entry.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def parquet_footer_hash(path: Path) -> str:
    """blake2b of the Parquet footer (file metadata: schema, row group offsets, sizes and statistics, kvbench's
    metadata with its creation time): a file rewritten with other content has another one."""
    return _stat_and_footer(path)[1]


def _stat_and_footer(path) -> tuple[os.stat_result, str]:
    """The file's stat and footer hash through one descriptor (a warm run's whole check of the file: ~25 us
    where `Path.resolve`, `stat` and buffered reads took ~45)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        tail = os.pread(fd, 8, max(st.st_size - 8, 0))
        length = int.from_bytes(tail[:4], "little")
        if len(tail) != 8 or tail[4:] != b"PAR1" or length + 8 > st.st_size:
            raise ValueError(f"{path}: no Parquet footer")
        return st, hashlib.blake2b(os.pread(fd, length, st.st_size - 8 - length), digest_size=16).hexdigest()
    finally:
        os.close(fd)


class CachedTrace:
    """A validated trace as its cache entry holds it: what the runner computes before the first point."""

    def __init__(self, info: dict, table: pa.Table, n_blocks: np.ndarray, infinite_hits: np.ndarray):
        self.meta = TraceMeta(info["block_size"], info["source"], info["created"], info["schema_version"])
        self.facts = {k: info[k] for k in ("fingerprint", "requests", "block_references")}
        self.table, self.n_blocks, self.infinite_hits = table, n_blocks, infinite_hits


class TraceCache:
    """The cache entry of one trace file. `for_file` gives None when the file cannot be identified."""

    def __init__(self, trace_path: Path, folder: Path, footer: str):
        self.trace_path, self.folder, self.footer = trace_path, folder, footer
        self.block_hashes_at = 0  # where block_hashes was among the trace's columns (`with_block_hashes`)
        self.writable = True  # False once a part could not be stored: the others are not tried (nor noted)

    @classmethod
    def for_file(cls, trace_path, root: Path | None = None) -> TraceCache | None:
        path = Path(os.path.abspath(trace_path))  # not resolved: a link and its target may have two entries
        try:
            st, footer = _stat_and_footer(path)
        except (OSError, ValueError):
            return None  # not there, not Parquet: reading it says what is wrong
        identity = (code_stamp(), str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        key = hashlib.blake2b(repr(identity).encode(), digest_size=16).hexdigest()
        return cls(path, (root or cache_root()) / key, footer)

    # --- the validated trace -------------------------------------------------------------------------------

    def load_trace(self) -> CachedTrace | None:
        """The trace part, or None (missing; or unreadable, with a note, and then rebuilt by the caller)."""
        part = self.folder / TRACE_PART
        if not part.is_dir():
            return None
        try:
            info = self._read_json(part / "trace.json")
            arrays = _load_arrays(part, info["arrays"])
            with pa.memory_map(str(part / "requests.arrow")) as source:
                table = pa.ipc.open_file(source).read_all()
            if table.num_rows != info["requests"] or arrays["n_blocks"].size != info["requests"]:
                raise ValueError(f"{table.num_rows} requests, {info['requests']} recorded")
            self.block_hashes_at = info["block_hashes_at"]
            return CachedTrace(info, table, arrays["n_blocks"], arrays["infinite_hits"])
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            self._unreadable(part, exc)
            return None

    def store_trace(self, meta: TraceMeta, facts: dict, table: pa.Table, n_blocks, infinite_hits) -> None:
        """Keep a validated trace: its facts, per-request block counts and infinite-cache hits, and its columns
        but block_hashes (the prepared keys stand for them)."""
        at = table.column_names.index("block_hashes")
        # one dictionary per column (Parquet gives one per row group): the IPC file format holds one
        light = table.remove_column(at).unify_dictionaries()
        arrays = {"n_blocks": np.asarray(n_blocks), "infinite_hits": np.asarray(infinite_hits)}
        info = {**dataclasses.asdict(meta), **facts, "block_hashes_at": at}

        def write(tmp: Path) -> None:
            with pa.OSFile(str(tmp / "requests.arrow"), "wb") as sink, pa.ipc.new_file(sink, light.schema) as w:
                w.write_table(light)
            self._write_json(tmp / "trace.json", {**info, "arrays": _save_arrays(tmp, arrays)})

        self._store(TRACE_PART, write)

    def with_block_hashes(self, table: pa.Table) -> pa.Table:
        """`table` (what `load_trace` gave) with block_hashes read from the trace file again, in its place: the
        whole trace, for a backend or preparation that needs the block ids. The file is the one the entry was
        made from (its key), validated then."""
        from kvbench.trace.files import read_trace

        if "block_hashes" in table.column_names:
            return table
        hashes = read_trace(self.trace_path, columns=["block_hashes"])[0].column("block_hashes")
        return table.add_column(self.block_hashes_at, "block_hashes", hashes)

    # --- prepared traces ------------------------------------------------------------------------------------

    @staticmethod
    def prepared_part(use_salt: bool, share_lora: bool, vllm_cap: bool) -> str:
        """Every option `prepare` takes besides the trace (block_size is the file's, in its key)."""
        return f"prepared-salt{int(use_salt)}-sharelora{int(share_lora)}-vllmcap{int(vllm_cap)}"

    def load_prepared(self, part: str):
        """The `PreparedTrace` kept under `part`, its arrays memory-mapped (copy on write), or None."""
        from kvbench.cache.prepared import PreparedTrace

        folder = self.folder / part
        if not folder.is_dir():
            return None
        try:
            info = self._read_json(folder / "prepared.json")
            arrays = _load_arrays(folder, info["arrays"])
            prepared = PreparedTrace(**info["scalars"], **arrays)
            n = prepared.input_tokens.size
            if prepared.offsets.size != n + 1 or prepared.keys.size != int(prepared.offsets[-1]):
                raise ValueError(f"offsets of {prepared.offsets.size} for {n} requests, {prepared.keys.size} keys")
            return prepared
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._unreadable(folder, exc)
            return None

    def store_prepared(self, part: str, prepared) -> None:
        """Keep a `PreparedTrace`: each array field (next uses included once computed), and the others."""
        fields = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
        arrays = {k: v for k, v in fields.items() if isinstance(v, np.ndarray)}
        scalars = {k: v for k, v in fields.items() if k not in arrays and v is not None}

        def write(tmp: Path) -> None:
            self._write_json(tmp / "prepared.json", {"scalars": scalars, "arrays": _save_arrays(tmp, arrays)})

        self._store(part, write, replace=True)

    # --- writing and reading parts -------------------------------------------------------------------------

    def _store(self, part: str, write, replace: bool = False) -> None:
        """Write `part` into a temporary folder beside it, make it durable, and rename it into place: a part
        under its final name is whole. Another process that stored it first wins (the same bytes); `replace`
        puts this one in place of an older one (a prepared trace stored again with its next uses)."""
        final = self.folder / part
        tmp = None
        if not self.writable:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{part}.", suffix=".tmp", dir=self.folder))
            write(tmp)
            for name in os.listdir(tmp):
                _fsync(tmp / name)
            _fsync(tmp)
            if replace and final.is_dir():
                old = final.with_name(f".{part}.{os.getpid()}.old")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            _fsync(self.folder)
            tmp = None
        except (OSError, TypeError, ValueError, pa.ArrowException) as exc:  # (the run goes on without it)
            if isinstance(exc, OSError) and final.is_dir():  # another run stored it first
                return
            self.writable = False
            if getattr(exc, "errno", None) not in _QUIET_ERRNOS:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
                _note(f"trace cache: could not store {final} ({why}); this run is not cached")
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _unreadable(self, folder: Path, exc: Exception) -> None:
        _note(f"trace cache: {folder} is unreadable ({type(exc).__name__}: {exc}); rebuilding it")
        shutil.rmtree(folder, ignore_errors=True)

    def _read_json(self, path: Path) -> dict:
        info = json.loads(path.read_text())
        if info.get("format") != CACHE_FORMAT or info.get("footer") != self.footer:
            raise ValueError(f"made for another file or format ({path.name})")
        return info

    def _write_json(self, path: Path, info: dict) -> None:
        path.write_text(json.dumps({"format": CACHE_FORMAT, "footer": self.footer, **info}))


ARRAYS_FILE = "arrays.bin"  # a part's arrays, one after another, each at a multiple of ALIGN bytes
ALIGN = 64


def _save_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> dict:
    """`arrays` into folder/arrays.bin; returns where each lies (dtype, shape, byte offset), which loading
    reads them by and checks against the file's size. One file, where one .npy an array took 0.3 ms each to
    load (header parsing, a memmap object): three times the lru kernel on the Mooncake trace."""
    layout, offset = {}, 0
    with open(folder / ARRAYS_FILE, "wb") as f:
        for name, values in arrays.items():
            values = np.ascontiguousarray(values)
            f.write(b"\0" * (-offset % ALIGN))
            offset += -offset % ALIGN
            layout[name] = [values.dtype.str, list(values.shape), offset]
            f.write(values.tobytes())
            offset += values.nbytes
    return {"layout": layout, "bytes": offset}


def _load_arrays(folder: Path, recorded: dict) -> dict[str, np.ndarray]:
    """The arrays `_save_arrays` wrote, views of the file memory-mapped copy on write (a kernel may take them as
    writable; a page is read when first used). A file of another size than recorded is refused."""
    with open(folder / ARRAYS_FILE, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != recorded["bytes"]:
            raise ValueError(f"{ARRAYS_FILE} has {size} bytes, {recorded['bytes']} recorded")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    out = {}
    for name, (dtype, shape, offset) in recorded["layout"].items():
        count = math.prod(shape)
        out[name] = np.frombuffer(buffer, np.dtype(dtype), count, offset).reshape(shape)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _note(message: str) -> None:
    warnings.warn(message, KvbenchWarning, stacklevel=3)
