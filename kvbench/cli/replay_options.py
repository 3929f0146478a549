"""The options of `kvbench replay` (kvbench.options fields), beside the command so that kvbench/cli/replay.py
stays about running it; `kvbench sweep` shares the defaults and help texts it names here."""

from __future__ import annotations

import dataclasses

import click

from kvbench import options
from kvbench.metrics.failures import DEFAULT_MAX_FAILURE_RATE
from kvbench.run.limits import CONTEXT_HELP, FIT_HELP, MAX_OUTPUT_HELP
from kvbench.run.runner import LIVE_EXECUTORS
from kvbench.trace.context import FIT_MODES
from kvbench.trace.stats import DEFAULT_WARMUP

DEFAULT_BACKEND = "sim"
TRACE_CACHE_HELP = (
    "offline backends, trace read whole: keep what reading and preparing TRACE computes (validation, "
    "fingerprint, infinite-cache hits; sim: dense block keys, 4-12 bytes of disk a block reference) in "
    "$KVBENCH_CACHE_DIR [default: ~/.cache/kvbench/prepared], keyed by the file's path, size and times, and load "
    "it on the next run of the same file (the first run pays the writing); results are the same either way. "
    "Delete the folder to clear it"
)


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """The options of `replay`."""

    backend: str = options.option(
        DEFAULT_BACKEND,
        "backend plug-in (kvbench.backends entry points); its options are listed below",
        unit="name",
    )
    out: str | None = options.option(
        None,
        "run directory; one that already holds a run is refused unless --resume or --overwrite "
        "[default: reports/<UTC time>-<backend>-<trace>/, with -2, -3, … if another run took the name]",
        unit="path",
        type=click.Path(file_okay=False),
    )
    overwrite: bool = options.option(
        False,
        "replace what --out holds (deleted once every option was checked, just before the new run starts)",
        unit="on/off",
        is_flag=True,
    )
    warmup: float = options.option(
        DEFAULT_WARMUP,
        "fraction of requests (by arrival) left out of steady-state metrics",
        unit="fraction",
        type=click.FloatRange(0, 1, max_open=True),
    )
    tenant_weights: str | None = options.option(
        None,
        "what each tenant pays for or is entitled to, relative (e.g. gold=3,free=1): fairness by entitlement "
        "compares each tenant's share of the hit tokens with its share of these weights",
        unit="unitless",
        metavar="TENANT=W,...",
    )
    tenant_slo: str | None = options.option(
        None,
        "TTFT/TPOT/E2EL targets per tenant, in ms, as --slo ('*' for the others; e.g. "
        "'gold:ttft=200,tpot=30;*:ttft=2000'): "
        "SLO attainment per tenant and whether each one's TTFT p99 is within its TTFT target, for backends that "
        "model or measure latency [default: the trace's slo_ttft_ms / slo_tpot_ms columns]",
        unit="ms",
        metavar="TENANT:ttft=MS,tpot=MS;...",
    )
    max_output_tokens: int | None = options.option(None, MAX_OUTPUT_HELP, unit="tokens", type=click.IntRange(min=1))
    context_tokens: int | None = options.option(
        None,
        CONTEXT_HELP,
        unit="tokens",
        flag="--context",
        type=click.IntRange(min=1),
    )
    fit_context: str = options.option("refuse", FIT_HELP, unit="name", type=click.Choice(FIT_MODES))
    like: str | None = options.option(
        None,
        "sim (and engine-sim, for vLLM): predict as the engine at URL is set up, from what it publishes "
        "(vLLM: /metrics cache_config_info and /v1/models; llama.cpp: /props and /slots): its policy, capacity, "
        "slots and context, printed; an option given here wins (docs/fidelity.md, Engine settings)",
        unit="URL",
        metavar="URL",
    )
    as_json: bool = options.option(False, "print summary.json to stdout", unit="on/off", flag="--json", is_flag=True)
    report: bool = options.option(
        True,
        "write report.md and report.html (plots) next to the results",
        unit="on/off",
        flag="--report/--no-report",
    )
    stream: str | None = options.option(
        None,
        "read the trace's block ids row group by row group, in bounded memory (sim: lru, vllm and the Belady "
        "bound, whose next uses take up to 40 bytes a block reference of scratch disk under $TMPDIR; no --curve) "
        "[default: stream traces of more than 60 million block references]",
        unit="on/off",
        flag="--stream/--no-stream",
    )
    trace_cache: bool = options.option(True, TRACE_CACHE_HELP, unit="on/off", flag="--trace-cache/--no-trace-cache")
    resume: bool = options.option(
        False,
        "live backends: continue the interrupted run in --out DIR; requests it answered (ok, error, timeout) "
        "are kept, the rest are sent. Refused when the pacing options differ from the first run's, unless --force",
        unit="on/off",
        is_flag=True,
    )
    force: bool = options.option(
        False,
        "with --resume: go on although the pacing options changed",
        unit="on/off",
        is_flag=True,
    )
    max_failure_rate: float = options.option(
        DEFAULT_MAX_FAILURE_RATE,
        "live backends: the share of sent requests (0-1) that may fail (error or timeout) before the command "
        "exits with status 3; the results are written either way. 0: any failed request fails the run",
        unit="fraction",
        type=click.FloatRange(0, 1),
    )
    workers: int = options.option(
        1,
        "live backends: load generators sharing the run, each with whole sessions (and what they depend on), all "
        "starting at one instant; --max-concurrency applies to each. More than 1 needs --executor ray. A worker "
        "lost with its node leaves its unanswered requests as worker_lost and the command exits with status 4; "
        "--resume sends them",
        unit="count",
        type=click.IntRange(min=1),
    )
    executor: str = options.option(
        "local",
        "local: one client in this process (--workers 1 only); ray: each worker a Ray actor, its results merged "
        "into this run",
        unit="name",
        type=click.Choice(LIVE_EXECUTORS),
    )
    ray_address: str = options.option(
        "",
        "with --executor ray: the cluster, 'auto' (the one `ray start` runs here) or ray://HOST:10001 "
        "[default: start a local cluster for this run]",
        unit="address",
        show_default=False,
    )
