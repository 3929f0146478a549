"""What every locally provisioned engine shares: its folder, venv, state file, process group and health wait.

An engine lives in `<root>/<name>/` where root is `$KVBENCH_ENGINE_DIR` or `~/.cache/kvbench/engines`
(`$XDG_CACHE_HOME` is honoured). That folder holds `venv/` (the engine's own Python environment, with a
marker file once the install succeeded), `models/` (the tiny models made locally, no hub access),
`server.log` and, while the engine runs, `state.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from kvbench.errors import KvbenchError

STATE_FILE = "state.json"
LOG_FILE = "server.log"
INSTALL_LOG = "install.log"
HEALTH_TIMEOUT_S = 300.0
STOP_GRACE_S = 20.0
LOG_TAIL_LINES = 30
# Who started an engine: `launch` records this variable's value in the state file, and `stop_owned(value)` stops
# the engines that carry it. A test session sets it to a token of its own (tests/conftest.py), so that it stops
# at its end the engines it started, and only those (one that already ran, a developer's or CI's, stays up).
OWNER_ENV = "KVBENCH_ENGINE_OWNER"

Progress = Callable[[str], None]


class EngineError(KvbenchError):
    """An engine could not be provisioned, started or stopped; the message says why and what to do."""


def quiet(_: str) -> None:
    pass


def engines_root() -> Path:
    env = os.environ.get("KVBENCH_ENGINE_DIR")
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvbench" / "engines"


def engine_dir(name: str) -> Path:
    return engines_root() / name


@dataclasses.dataclass
class EngineInfo:
    """A running (or recorded) engine, as written to its state file."""

    engine: str
    pid: int
    port: int
    url: str  # base URL, e.g. http://127.0.0.1:8011 (OpenAI routes under /v1)
    model: str  # served model name to put in requests
    block_size: int | None  # KV block size in tokens (None where the engine has no paged blocks)
    log_path: str
    args: list[str]  # the full server command line
    settings: dict  # the options it was started with (compared on `up` to decide whether to reuse it)
    started: float  # Unix time
    proc_start: int | None = None  # /proc/<pid>/stat start time, to tell our process from a reused pid
    env: dict = dataclasses.field(default_factory=dict)  # extra environment variables it was started with
    owner: str | None = None  # $KVBENCH_ENGINE_OWNER of whoever started it (kept across a restart), or None

    @property
    def uptime_s(self) -> float:
        return time.time() - self.started

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> EngineInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# --- processes -----------------------------------------------------------------------------------------


def _proc_start(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def pid_alive(pid: int, proc_start: int | None = None) -> bool:
    """True while `pid` runs and is the process that was recorded (not a zombie, not a reused pid)."""
    try:  # reap it if it is our own child that has exited (tests start engines in-process)
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if _proc_state(pid) in ("Z", "X"):
        return False
    if proc_start is not None and Path("/proc").is_dir():
        return _proc_start(pid) == proc_start
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server runs in its own session, so its pgid is its pid
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def stop_process_group(pid: int, proc_start: int | None = None, grace_s: float = STOP_GRACE_S) -> str:
    """SIGTERM the process group, wait up to `grace_s`, then SIGKILL. Returns how it ended."""
    if not pid_alive(pid, proc_start):
        return "not running"
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not pid_alive(pid, proc_start):
            _signal_group(pid, signal.SIGKILL)  # stragglers of the group (worker processes), if any
            return "stopped"
        time.sleep(0.2)
    _signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pid_alive(pid, proc_start):
        time.sleep(0.1)
    return "killed"


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (vLLM runs its engine core in a child process)."""
    total = 0
    pids = [pid]
    seen = set()
    while pids:
        p = pids.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                pids.extend(int(c) for c in children)
        except (OSError, ValueError):
            continue
    return total


# --- HTTP ------------------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback only)
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        return http_get(url.rstrip("/") + "/health", timeout)[0] == 200
    except (OSError, ValueError):
        return False


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# --- files -----------------------------------------------------------------------------------------------


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return f"({path} could not be read)"
    return "\n".join(text.splitlines()[-lines:])


def read_state(name: str) -> EngineInfo | None:
    path = engine_dir(name) / STATE_FILE
    try:
        return EngineInfo.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_state(info: EngineInfo) -> Path:
    path = engine_dir(info.engine) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def remove_state(name: str) -> None:
    (engine_dir(name) / STATE_FILE).unlink(missing_ok=True)


def run_logged(cmd: Sequence[str | Path], log: Path, what: str, env: dict | None = None, cwd=None) -> None:
    """Run a provisioning step with its output appended to `log`; on failure raise with the log's tail."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        f.flush()
        proc = subprocess.run(
            [str(c) for c in cmd],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=clean_env() if env is None else env,
            cwd=cwd,
        )
    if proc.returncode != 0:
        raise EngineError(
            f"{what} failed (exit {proc.returncode}); last lines of {log}:\n{log_tail(log)}\n"
            f"hint: fix the cause and rerun; completed steps are skipped"
        )


def current_owner() -> str | None:
    return os.environ.get(OWNER_ENV) or None


def clean_env() -> dict:
    """The caller's environment without what would leak kvbench's own Python into an engine's venv (nor who
    owns it: an engine's own subprocesses start no engines)."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", OWNER_ENV)
    return {k: v for k, v in os.environ.items() if k not in drop}


def ensure_venv(venv: Path, progress: Progress = quiet) -> Path:
    """Create `venv` with the current interpreter unless it exists; returns its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        progress(f"creating venv {venv}")
        if venv.exists():
            shutil.rmtree(venv)  # a half-made venv from an interrupted run
        venv.parent.mkdir(parents=True, exist_ok=True)
        log = venv.parent / INSTALL_LOG
        run_logged([sys.executable, "-m", "venv", venv], log, f"python -m venv {venv}")
    return python


def marker_matches(marker: Path, expected: dict) -> bool:
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return all(data.get(k) == v for k, v in expected.items())


def write_marker(marker: Path, data: dict) -> None:
    marker.write_text(json.dumps({**data, "time": time.time()}, indent=2) + "\n")


@contextlib.contextmanager
def engine_lock(name: str, progress: Progress = quiet):
    """Serialise `up`/`down` of one engine across processes (two `engine up` must not pip-install at once)."""
    folder = engine_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another `kvbench engine up/down {name}` to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- start and wait -------------------------------------------------------------------------------------


def launch(
    name: str,
    cmd: list[str],
    *,
    port: int,
    model: str,
    block_size: int | None,
    settings: dict,
    env_extra: dict,
    progress: Progress = quiet,
    timeout_s: float = HEALTH_TIMEOUT_S,
    hint: str = "",
    owner: str | None = None,
) -> EngineInfo:
    """Start `cmd` detached (own session and process group, output to server.log), wait for /health, record it
    (with `owner`, see OWNER_ENV)."""
    folder = engine_dir(name)
    log_path = folder / LOG_FILE
    url = f"http://127.0.0.1:{port}"
    env = {**clean_env(), **env_extra}
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=folder,
            start_new_session=True,
        )
    info = EngineInfo(
        engine=name,
        pid=proc.pid,
        port=port,
        url=url,
        model=model,
        block_size=block_size,
        log_path=str(log_path),
        args=cmd,
        settings=settings,
        started=time.time(),
        proc_start=_proc_start(proc.pid),
        env=env_extra,
        owner=owner,
    )
    write_state(info)  # recorded at once, so that `engine down` can stop a server that is still starting
    t0 = time.monotonic()
    try:
        while True:
            code = proc.poll()
            if code is not None:
                remove_state(name)
                raise EngineError(
                    f"{name} exited with code {code} while starting; last {LOG_TAIL_LINES} lines of {log_path}:\n"
                    f"{log_tail(log_path)}\n"
                    f"hint: {hint or 'see the log above'}"
                )
            if healthy(url, timeout=2.0):
                return info
            waited = time.monotonic() - t0
            if waited > timeout_s:
                stop_process_group(proc.pid, info.proc_start)
                remove_state(name)
                raise EngineError(
                    f"{name} did not answer GET {url}/health within {timeout_s:.0f} s (stopped it); "
                    f"last {LOG_TAIL_LINES} lines of {log_path}:\n{log_tail(log_path)}"
                )
            progress(f"waiting for {name} at {url}/health ({waited:.0f} s, log: {log_path})")
            time.sleep(0.5)
    except KeyboardInterrupt:
        stop_process_group(proc.pid, info.proc_start)
        remove_state(name)
        raise
