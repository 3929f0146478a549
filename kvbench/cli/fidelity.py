"""`kvbench fidelity`: the calibration triangle in one command (docs/fidelity.md). Calibrate the endpoint (unless
given a calibration file), replay a trace against it live, replay the same requests through engine-sim with the
live run's send times and output lengths, its scheduler limits and KV pool, and report how far the model is from
the measurement request by request: TTFT, TPOT, E2EL errors and cached-token exactness."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvbench import options
from kvbench.cli.render import console
from kvbench.errors import KvbenchError
from kvbench.run.results import read_requests
from kvbench.run.rundir import RunDir, stamp
from kvbench.trace.schema import cap_outputs

WORKLOADS = ("chat", "agent", "multi-tenant", "multimodal", "reasoning")


def _kvbench(*args) -> None:
    """Run a kvbench subcommand in its own process (its progress goes to the terminal); fail with its message."""
    cmd = [sys.executable, "-c", "import sys; from kvbench.cli import main; sys.exit(main())", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise KvbenchError(f"`kvbench {shlex.join(map(str, args))}` failed: {' '.join(tail)}")


async def _server(url: str, model: str | None) -> dict:
    import aiohttp

    from kvbench.live.endpoint import model_info, server_facts
    from kvbench.live.servers import llama_facts, request_context

    async with aiohttp.ClientSession() as session:
        name, max_len = await model_info(session, url, model)
        llama = await llama_facts(session, url) or {}
        facts = {"model": name, **await server_facts(session, url), **llama}
        return {**facts, "max_model_len": request_context(max_len, llama)}


def _engine_sim_setup(server: dict, block_size: int | None, trace_block_size: int, hbm_capacity, max_num_seqs,
                      max_num_batched_tokens) -> dict:  # fmt: skip
    """engine-sim's policy, pool, block size and scheduler limits for the engine `server` describes; an option the
    user gave wins. vLLM: its block pool (`vllm`, num_gpu_blocks), 128 sequences and 2048 tokens a step (its CPU
    defaults). llama.cpp: `llama-slot` over the whole context in blocks (its slots when they split the context),
    its slots as the sequences a step runs (`--parallel` decode together in one batch) and its n_batch as the
    tokens a step takes (each iteration fills one batch: generating slots' tokens first, then prompt tokens)."""
    from kvbench.live.servers import step_budget

    if server.get("engine") == "llama.cpp":
        bs = block_size or trace_block_size  # no blocks in llama-server: the trace's own cut serves the policy
        total = server.get("total_context_tokens") or server.get("context_tokens")
        capacity = hbm_capacity or (-(-int(total) // bs) if total else None)
        setup = {"policy": "llama-slot", "block_size": bs, "hbm_capacity": capacity,
                 "max_num_seqs": max_num_seqs or int(server.get("slots") or 1),
                 "max_num_batched_tokens": step_budget(max_num_batched_tokens, server)}  # fmt: skip
        if server.get("unified_kv") is False and server.get("slots"):
            setup["slots"] = int(server["slots"])
        return setup
    return {"policy": "vllm", "block_size": block_size or server.get("block_size"),
            "hbm_capacity": hbm_capacity or server.get("num_gpu_blocks"), "max_num_seqs": max_num_seqs or 128,
            "max_num_batched_tokens": step_budget(max_num_batched_tokens, server)}  # fmt: skip


def _prepare_trace(src: Path, out: Path, n: int, max_out: int, max_len: int | None, block_size: int) -> dict:
    """The first `n` requests of `src` that fit the engine's context, outputs capped at `max_out`, re-cut to the
    engine's block size: the one file both replays read."""
    table = pq.read_table(src)
    meta = table.schema.metadata
    table = cap_outputs(table, max_out, least=1)
    outputs = table["output_tokens"]
    fits = np.ones(table.num_rows, bool)
    if max_len:
        fits = (table["input_tokens"].to_numpy() + outputs.to_numpy()) <= max_len
    kept = table.filter(pa.array(fits)).slice(0, n).replace_schema_metadata(meta)
    if not kept.num_rows:
        raise KvbenchError(f"{src}: no request fits the engine's {max_len}-token context with its output")
    capped = out / "trace-capped.parquet"
    pq.write_table(kept, capped)
    _kvbench("trace", "rebase", capped, "--block-size", block_size, "-o", out / "trace.parquet")
    capped.unlink()
    return {"source": str(src), "requests": kept.num_rows, "left_out_too_long": int((~fits).sum())}


def _modeled_trace(trace: Path, live_dir: Path, out: Path) -> int:
    """The trace's requests that the live run answered, arriving when the live run sent them."""
    live = read_requests(live_dir)
    live = live.filter(pc.equal(live["status"], "ok"))
    sent = dict(zip(live["request_id"].to_pylist(), live["actual_send_s"].to_pylist(), strict=True))
    table = pq.read_table(trace)
    meta = table.schema.metadata
    keep = [i for i, rid in enumerate(table["request_id"].to_pylist()) if rid in sent]
    table = table.take(pa.array(keep, pa.int64()))
    times = np.array([sent[rid] for rid in table["request_id"].to_pylist()], dtype=np.float64)
    order = np.argsort(times, kind="stable")
    table = table.take(pa.array(order))
    arrival = times[order] - (times.min() if times.size else 0.0)
    table = table.set_column(table.schema.get_field_index("arrival_s"), "arrival_s", pa.array(arrival))
    for col in ("depends_on", "parent_id", "think_time_s"):  # the live send times already honour them
        if col in table.column_names:
            table = table.drop_columns([col])
    pq.write_table(table.replace_schema_metadata(meta), out)
    return table.num_rows


@dataclasses.dataclass(frozen=True)
class FidelityOptions:
    """The options of `fidelity`."""

    url: str | None = options.option(
        None,
        "engine base URL, e.g. http://127.0.0.1:8011",
        unit="URL",
        envvar="KVBENCH_URL",
        required=True,
    )
    model: str | None = options.served_model(
        "model name to request [default: the first of GET /v1/models] (a name, not a geometry)"
    )
    api_key_env: str = options.option("OPENAI_API_KEY", "environment variable with the key", unit="name")
    workload: str = options.option(
        "chat",
        "without TRACE: generate a trace of this kind (`kvbench trace gen`)",
        unit="name",
        type=click.Choice(WORKLOADS),
    )
    seed: int | None = options.option(
        None,
        "without TRACE: generator seed [default: a fresh one, recorded]",
        unit="integer",
        type=int,
    )
    n_requests: int = options.option(
        60,
        "requests replayed (the first that fit the engine's context)",
        unit="requests",
        flag="--requests",
        type=click.IntRange(min=2),
    )
    concurrency: int = options.option(
        1,
        "requests in flight at most; each is sent as soon as a slot frees",
        unit="requests",
        type=click.IntRange(min=1),
    )
    max_output_tokens: int = options.option(
        32,
        "output tokens per request at most (exact: ignore_eos)",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    calibration: str | None = options.option(
        None,
        "a `kvbench calibrate` file to use [default: calibrate the endpoint first]",
        unit="path",
        type=click.Path(exists=True, dir_okay=False),
    )
    calibrate_repeats: int = options.option(
        3,
        "repeats of every calibration point (when calibrating)",
        unit="count",
        type=click.IntRange(min=1),
    )
    max_num_seqs: int | None = options.option(
        None,
        "the engine's sequences per step [default: vLLM's CPU default 128; llama.cpp: its slots]",
        unit="sequences",
        type=click.IntRange(min=1),
    )
    max_num_batched_tokens: int | None = options.option(
        None,
        "the engine's tokens per step [default: vLLM's CPU default 2048; llama.cpp: its n_batch, -b, "
        "from its recorded arguments, else 2048]",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    hbm_capacity: str | None = options.option(
        None,
        "the engine's KV pool in blocks [default: vLLM: num_gpu_blocks from its "
        "/metrics; llama.cpp: its whole context in blocks]",
        unit="blocks",
    )
    block_size: int | None = options.option(
        None,
        "the engine's KV block size in tokens [default: vLLM: from its /metrics; llama.cpp, which "
        "has none: the trace's]",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    sim_model: str = options.option(
        "kvbench-tiny",
        "engine-sim model geometry: bytes of KV per token (a preset of kvbench.cache.capacity)",
        unit="name",
    )
    hardware: str = options.option(
        "cpu",
        "engine-sim hardware preset (the calibration replaces its step times)",
        unit="name",
    )
    skip_first: int = options.option(
        2,
        "requests (the first sent) left out of the error: first requests pay one-off costs",
        unit="requests",
        type=click.IntRange(min=0),
    )
    out: str | None = options.option(
        None,
        "run directory; one that holds something is refused unless --overwrite "
        "[default: reports/<time>-fidelity-<name>]",
        unit="path",
        type=click.Path(file_okay=False),
    )
    overwrite: bool = options.option(False, "replace what --out holds", unit="on/off", is_flag=True)


@click.command()
@click.argument("trace_path", metavar="[TRACE]", required=False, type=click.Path(exists=True, dir_okay=False))
@options.command_options(FidelityOptions)
def fidelity(trace_path, url, model, api_key_env, workload, seed, n_requests, concurrency, max_output_tokens,
             calibration, calibrate_repeats, max_num_seqs, max_num_batched_tokens, hbm_capacity, block_size, sim_model,
             hardware, skip_first, out, overwrite):  # fmt: skip
    """How far engine-sim is from a live engine on the same requests: calibrate, replay live, replay modeled
    (the live send times, output lengths, scheduler limits and KV pool), and report per-request TTFT / TPOT /
    E2EL errors (MAPE, median ratio, p90) and cached-token exactness, overall, by workload and by tenant."""
    from kvbench.live.endpoint import base_url, host_port, shown
    from kvbench.run import fidelity as F
    from kvbench.run.runner import run_replay

    url = base_url(url)
    name = Path(trace_path).stem if trace_path else workload
    run_dir = RunDir.claim(
        out, Path("reports") / f"{stamp()}-fidelity-{name}", overwrite=overwrite, what="fidelity run", resumable=False
    ).path
    try:
        server = asyncio.run(_server(url, model))
    except OSError as exc:
        raise KvbenchError(f"cannot reach {shown(url)} ({exc}); is the engine up? (`kvbench engine status`)") from None
    llama = server.get("engine") == "llama.cpp"
    if not llama and not (block_size or server.get("block_size")):
        raise KvbenchError(
            f"{shown(url)} does not say its KV block size in /metrics (vLLM's cache_config_info); give --block-size"
        )
    # the machine's load while it ran (a shared machine moves the live side): 1-minute load average, start and end
    summary = {"command": "kvbench fidelity " + shlex.join(sys.argv[2:]), "created": stamp,
               "endpoint": host_port(url), "server": server, "complete": False,
               "load_avg_1min": [round(os.getloadavg()[0], 2)]}  # fmt: skip
    if not trace_path:
        seed = seed if seed is not None else secrets.randbits(31)
        trace_path = run_dir / f"generated-{workload}.parquet"
        console.print(f"generating a {workload} trace (seed {seed})")
        _kvbench("trace", "gen", workload, "-n", max(4 * n_requests, 200), "--seed", seed, "-o", trace_path)
        summary["generated"] = {"workload": workload, "seed": seed}
    from kvbench.trace.files import read_meta

    setup = _engine_sim_setup(server, block_size, read_meta(trace_path).block_size, hbm_capacity, max_num_seqs,
                              max_num_batched_tokens)  # fmt: skip
    block_size, capacity = setup["block_size"], setup["hbm_capacity"]
    max_num_seqs, max_num_batched_tokens = setup["max_num_seqs"], setup["max_num_batched_tokens"]
    if not capacity:
        raise KvbenchError("give the engine's KV pool with --hbm-capacity BLOCKS (the engine does not say it)")
    summary["trace"] = _prepare_trace(Path(trace_path), run_dir, n_requests, max_output_tokens,
                                      server.get("max_model_len"), block_size)  # fmt: skip
    trace = run_dir / "trace.parquet"
    if calibration is None:
        calibration = run_dir / "calibration.toml"
        console.print(f"calibrating {shown(url)} (kvbench calibrate)")
        _kvbench("calibrate", "--url", url, "-o", calibration, "--repeats", calibrate_repeats,
                 "--api-key-env", api_key_env, "--max-num-batched-tokens", max_num_batched_tokens)  # fmt: skip
    summary["calibration"] = str(calibration)
    console.print(f"live: {summary['trace']['requests']} requests at concurrency {concurrency}")
    live_opts = {"url": url, "served_model": model, "api_key_env": api_key_env, "mode": "rate", "rate": 1e6,
                 "max_concurrency": concurrency, "send_lora": False,
                 # llama-server has no route that empties its slots and host prompt cache: a fresh trace (a new
                 # seed) shares no token with what they hold, so nothing earlier is served from them
                 "reset_prefix_cache": not llama}  # fmt: skip
    live_dir, _ = run_replay(trace, "openai", live_opts, out=run_dir / "live")
    modeled_trace = run_dir / "trace-modeled.parquet"
    _modeled_trace(trace, live_dir, modeled_trace)
    sim_opts = {"policy": setup["policy"], "hardware": hardware, "model": sim_model, "hbm_capacity": str(capacity),
                "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "calibration": str(calibration), "share_lora_kv": True, "max_concurrency": concurrency,
                **({"slots": setup["slots"]} if "slots" in setup else {})}  # fmt: skip
    model_dir, _ = run_replay(modeled_trace, "engine-sim", sim_opts, out=run_dir / "modeled")
    table = F.fidelity(read_requests(live_dir), read_requests(model_dir),
                       skip=skip_first)  # fmt: skip
    summary["load_avg_1min"].append(round(os.getloadavg()[0], 2))
    summary.update({"live": "live", "modeled": "modeled", "fidelity": table, "complete": True,
                    "settings": {"concurrency": concurrency, "max_output_tokens": max_output_tokens,
                                 "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                                 "hbm_capacity_blocks": int(capacity), "sim_model": sim_model,
                                 "hardware": hardware, "policy": setup["policy"], "block_size": block_size,
                                 **({"slots": setup["slots"]} if "slots" in setup else {})}})  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _write_reports(run_dir, summary)
    _print(table)
    console.print(f"run: {run_dir}")


def _write_reports(run_dir: Path, summary: dict) -> None:
    from kvbench.report.fidelity import TITLE, FidelityTable, explanation, html_ready
    from kvbench.report.page import Links, Section, Table, render_html, render_markdown

    settings = [[k, str(v)] for k, v in summary["settings"].items()]
    settings += [["endpoint", summary["endpoint"]], ["calibration", summary["calibration"]],
                 ["trace", summary["trace"]["source"]], ["requests", str(summary["trace"]["requests"])]]  # fmt: skip
    sections = [
        Section(TITLE, [explanation(summary["fidelity"]["skipped_first"]), FidelityTable.of(summary["fidelity"])]),
        Section("Settings", [f"`{summary['command']}`", Table(["setting", "value"], settings)]),
        Section("Runs", [Links([("live run", "live/report.html"), ("modeled run", "modeled/report.html")])]),
    ]
    title = f"kvbench fidelity: engine-sim vs {summary['endpoint']}"
    (run_dir / "report.html").write_text(render_html(title, html_ready(sections)))
    (run_dir / "report.md").write_text(render_markdown(title, sections).rstrip("\n") + "\n")


def _print(table: dict) -> None:
    from kvbench.report.fidelity import fidelity_markdown

    click.echo(fidelity_markdown(table))
