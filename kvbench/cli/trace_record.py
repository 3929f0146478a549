"""`kvbench trace record`: record a live deployment's traffic as a trace through a reverse proxy
(`kvbench.live.recorder`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import click

from kvbench import options
from kvbench.errors import KvbenchError
from kvbench.redact import redact_url
from kvbench.trace.keyed import KEY_ENV, hash_key


async def serve(recorder, host: str, port: int, say=click.echo) -> None:
    """Serve until cancelled (Ctrl-C, SIGTERM: the CLI turns both into a cancellation of this task), then let
    in-flight requests end and commit the last rows."""
    from aiohttp import web

    runner = web.AppRunner(recorder.app(), access_log=None, shutdown_timeout=10.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise KvbenchError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port") from None
    say(f"recording: point clients at http://{host}:{port}/v1 (upstream {redact_url(recorder.upstream)}); Ctrl-C ends")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()  # runs the app's cleanup: pending rows recorded and committed


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """The options of `record`."""

    upstream: str | None = options.option(
        None,
        "the OpenAI-compatible server to forward to, e.g. http://localhost:8000 (a trailing /v1 is dropped)",
        unit="URL",
        metavar="URL",
    )
    out: str | None = options.option(
        None,
        "the trace to write (Parquet)",
        unit="path",
        flag=("--out", "-o"),
        type=click.Path(dir_okay=False),
        required=True,
    )
    host: str = options.option("127.0.0.1", "address to listen on (0.0.0.0: every interface)", unit="address")
    port: int = options.option(8080, "TCP port to listen on", unit="TCP port", type=click.IntRange(1, 65535))
    block_size: int = options.option(
        16,
        "tokens per hashed block (the engine's KV block size)",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    tokenizer: str | None = options.option(
        None,
        "a local tokenizer.json; without it the upstream's /tokenize is asked (vLLM, SGLang)",
        unit="path",
        type=click.Path(exists=True, dir_okay=False),
    )
    session_header: str | None = options.option(
        None,
        "request header that holds the session id, e.g. X-Session-Id",
        unit="name",
        metavar="HEADER",
    )
    session_field: str | None = options.option(
        None,
        "top-level request body field that holds the session id",
        unit="name",
        metavar="FIELD",
    )
    user_header: str | None = options.option(
        None,
        "request header that holds the user id",
        unit="name",
        metavar="HEADER",
    )
    user_field: str = options.option("user", "body field of the user id", unit="name", metavar="FIELD")
    tenant_header: str | None = options.option(
        None,
        "request header that holds the tenant",
        unit="name",
        metavar="HEADER",
    )
    tenant_field: str | None = options.option(
        None,
        "top-level request body field that holds the tenant",
        unit="name",
        metavar="FIELD",
    )
    priority_header: str | None = options.option(
        None,
        "request header with the priority (an integer 0-100)",
        unit="name",
        metavar="HEADER",
    )
    priority_field: str | None = options.option(
        None,
        "body field with the priority (an integer 0-100)",
        unit="name",
        metavar="FIELD",
    )
    base_model: str | None = options.option(
        None,
        "the served base model: any other model name is recorded as lora",
        unit="name",
        metavar="NAME",
    )
    commit_every: float = options.option(
        1.0,
        "seconds between commits of recorded rows to disk (a killed proxy loses at most this much)",
        unit="s",
        type=click.FloatRange(min=0.01),
    )
    finish: bool = options.option(
        False,
        "write the trace of a recording that was killed, from OUT.parts/, and exit",
        unit="on/off",
        is_flag=True,
    )


@click.command("record")
@options.command_options(RecordOptions)
def record(upstream, out, host, port, block_size, tokenizer, commit_every, finish, **labels) -> None:
    """Record live traffic as a trace: a reverse proxy forwards every request to --upstream unchanged (streams
    pass through as they come) and writes one row per /v1/completions or /v1/chat/completions request:
    arrival time (seconds since the start), prompt tokens and their keyed block ids, output tokens, the
    server's cached tokens (recorded_cached_tokens, when the answer's usage says it; a stream's usage comes
    only if the client asked for it with stream_options.include_usage, otherwise output tokens are counted
    from the stream), status, and session/user/tenant/priority labels. Block ids are hashed with the secret in
    $KVBENCH_HASH_KEY (never stored); no prompt text is written anywhere. Rows are committed to OUT.parts/
    as the run goes; Ctrl-C or SIGTERM writes OUT.
    """
    # imported here: the proxy needs aiohttp (the live extra), and the rest of the CLI loads without it
    try:
        from kvbench.live import recordparts
        from kvbench.live.recorder import Recorder, RecordOptions
    except ImportError as exc:
        raise KvbenchError(f"kvbench trace record needs the live extra ({exc}): pip install 'kvbench[live]'") from None

    out = Path(out)
    if finish:
        rows = recordparts.finish(out)
        click.echo(f"wrote {out} ({rows:,} requests)")
        return
    if not upstream:
        raise KvbenchError("give --upstream URL, the server to record in front of (or --finish to write a trace)")
    if out.exists():
        raise KvbenchError(f"{out} exists; choose another --out or remove it")
    key = hash_key(KEY_ENV)
    options = RecordOptions(block_size=block_size, commit_every_s=commit_every, **labels)
    recorder = Recorder(upstream, out, key, options, Path(tokenizer) if tokenizer else None)
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        asyncio.run(serve(recorder, host, port))
    skipped = f"; {recorder.skipped} not tokenizable, forwarded only" if recorder.skipped else ""
    if not recordparts.list_parts(out):
        click.echo(f"nothing recorded{skipped}", err=True)
        return
    rows = recordparts.finish(out)
    click.echo(f"wrote {out} ({rows:,} requests{skipped})")
