"""`sim`: the offline prefix-cache simulator (docs/semantics.md, Policies). Requests are processed one at a
time in arrival order; each policy x capacity is one point; the Belady bound runs beside the real policies."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import click
import numpy as np
import pyarrow as pa

from kvbench import options
from kvbench.cache import policies as _policies
from kvbench.cache.capacity import check_capacities, parse_capacities
from kvbench.cache.policies import SimOutput
from kvbench.cache.policy_options import check_quota_tenants, parse_policy_options, policy_option_params
from kvbench.cache.prepared import PreparedTrace, prepare
from kvbench.errors import KvbenchError
from kvbench.models import KV_DTYPE_BYTES, MODELS
from kvbench.options import option
from kvbench.run.backend import PointResult, Progress, Skipped, StreamedPoint
from kvbench.trace.files import TraceMeta

BOUND = "belady"
CURVE_POINTS = 96  # capacities sampled from the one-pass curve for the summary and the plot


def _policy_help() -> str:
    listing = ", ".join(f"{n} ({p.summary.rstrip('.')})" for n, p in _policies.registry().items())
    return f"eviction policy, or several separated by commas: {listing}"


@dataclass
class SimConfig:
    """The options of `kvbench replay --backend sim` (kvbench.options): flags, help, config() keys."""

    policy: str = option("lru", _policy_help, unit="name(s)", key="policies")
    capacity: str | None = option(
        None,
        "cache size(s), comma-separated: blocks (10000), tokens (5M tok) or bytes (40GiB, needs --model); a list "
        "makes a sweep. For vllm: the engine's KV blocks (num_gpu_blocks), one of which is its null block",
        unit="blocks, tokens or bytes",
    )
    model: str | None = option(
        None,
        "model geometry preset that converts byte capacities to tokens (KV bytes per token)",
        unit="name",
        type=click.Choice(list(MODELS)),
    )
    kv_dtype: str = option(
        "bf16", "KV cache element type: scales bytes per token", unit="name", type=click.Choice(list(KV_DTYPE_BYTES))
    )
    curve: bool = option(
        False,
        "the full hit-rate-vs-capacity curve of lru in one pass (stack distances), with the Belady bound at a few "
        "capacities",
        unit="on/off",
        is_flag=True,
    )
    bound: bool = option(
        True, "also run the Belady optimum at the same capacities (the upper bound)", unit="on/off",
        flag="--bound/--no-bound",
    )  # fmt: skip
    salt: bool = option(
        True, "fold cache_salt into cache keys (tenants with different salts never share blocks)", unit="on/off",
        flag="--salt/--no-salt",
    )  # fmt: skip
    share_lora_kv: bool = option(
        False,
        "let requests of different LoRA adapters share KV (default: the adapter is in the key)",
        unit="on/off",
        is_flag=True,
    )
    reference: bool = option(
        False, "use the pure-Python reference implementations (slow; for verification)", unit="on/off", is_flag=True
    )


class SimBackend:
    name = "sim"
    kind = "streaming"  # kvbench.run.backend.StreamingBackend
    Config = SimConfig

    @classmethod
    def cli_options(cls) -> list[click.Option]:
        return options.cli_options(SimConfig) + policy_option_params()

    DEMO_POLICIES = "lru,radix-lru,s3fifo,vllm"
    DEMO_CAPACITY_SHARES = (0.05, 0.2, 0.5)  # of the trace's distinct blocks: tight, middling, roomy

    @classmethod
    def demo_options(cls, trace: pa.Table, meta: TraceMeta) -> dict:
        """`kvbench demo`: four policies at three cache sizes relative to the trace's working set, the
        Belady bound beside them, and the one-pass LRU curve."""
        import pyarrow.compute as pc

        unique = pc.count_distinct(pc.list_flatten(trace.column("block_hashes"))).as_py()
        caps = sorted({max(16, int(unique * s)) for s in cls.DEMO_CAPACITY_SHARES})
        return {"policy": cls.DEMO_POLICIES, "capacity": ",".join(map(str, caps)), "curve": True}

    def __init__(self, config: SimConfig | None = None, **kwargs):
        """`config`, or its fields as keyword arguments; the other keywords are policy options (--quota, …)."""
        cfg, policy_options = options.build(SimConfig, config, kwargs)
        known = _policies.registry()
        self.options = cfg
        self.policies = _policies.parse_names(cfg.policy)
        if cfg.capacity is None and not cfg.curve:
            raise KvbenchError("give --capacity (e.g. --capacity 10000 or 1000,3000,10000) or --curve")
        if cfg.curve and not any(known[p].stack for p in self.policies):
            stack = ", ".join(n for n, p in known.items() if p.stack)
            raise KvbenchError(f"--curve needs a stack policy ({stack}); got --policy {cfg.policy}")
        if cfg.capacity is not None:  # everything but 'less than one block', which needs the trace's block size
            check_capacities(cfg.capacity, cfg.model, cfg.kv_dtype)
        self.capacity_spec, self.model, self.kv_dtype = cfg.capacity, cfg.model, cfg.kv_dtype
        self.curve, self.bound, self.salt, self.share_lora_kv = cfg.curve, cfg.bound, cfg.salt, cfg.share_lora_kv
        self.reference = cfg.reference
        self.policy_options = parse_policy_options(policy_options, self.policies)

    def config(self) -> dict:
        return options.record(self.options, policy=self.policies, policy_options=self.policy_options)

    @staticmethod
    def _check_needs(pol, filled) -> None:
        """`filled`: the trace columns with at least one value."""
        for col in pol.needs:
            if col not in filled:
                raise KvbenchError(
                    f"policy {pol.name} needs the trace column {col!r}, which is empty in this "
                    f"trace; pick another policy or a trace that has {col}"
                )

    def replay(self, trace: pa.Table, meta: TraceMeta, progress=None) -> Iterator[PointResult]:
        return self.replay_cached(trace, meta, None, progress)

    def replay_cached(self, trace: pa.Table, meta: TraceMeta, cache, progress=None) -> Iterator[PointResult]:
        """`replay`, each prepared trace (`kvbench.cache.prepared`) loaded from the trace cache's entry `cache`
        when it holds one for these options, else prepared and stored there (`TraceCacheUser`)."""
        bs = meta.block_size
        caps = (
            parse_capacities(self.capacity_spec, bs, self.model, self.kv_dtype)
            if self.capacity_spec is not None
            else []
        )
        names = list(self.policies)
        if self.bound and BOUND not in names and caps:
            names.append(BOUND)
        pols = [_policies.get(n) for n in names]
        filled = {c for c in trace.column_names if trace.column(c).null_count < trace.num_rows}
        for pol in pols:
            self._check_needs(pol, filled)
        if "quota" in self.policy_options:
            from kvbench.cache.prepared import tenant_codes

            check_quota_tenants(self.policy_options, tenant_codes(trace, None)[1])
        prepared, had_next_use = {}, set()

        extended = {}

        def prepared_for(name):
            cap = name == "vllm"  # vLLM recomputes at least the last prompt token
            if cap not in prepared:
                prepared[cap] = self._prepare(trace, bs, cap, cache)
                if prepared[cap].next_use_known:
                    had_next_use.add(cap)
            extend = _policies.get(name).extend  # a policy that reads more than block keys (llama-slot's tokens)
            if extend is None:
                return prepared[cap]
            if name not in extended:
                whole = cache.with_block_hashes(trace) if cache is not None else trace
                extended[name] = extend(whole, bs, self.policy_options, prepared[cap])
            return extended[name]

        for pol in pols:
            for cap in caps:
                yield self._point(pol, prepared_for(pol.name), cap.blocks, cap.text)
        if self.curve:
            yield from self._curves(pols, prepared_for)
        if cache is not None:  # the Belady bound's next uses, computed on demand, are kept for the next run
            for cap, prep in prepared.items():
                if prep.next_use_known and cap not in had_next_use:
                    cache.store_prepared(cache.prepared_part(self.salt, self.share_lora_kv, cap), prep)

    def _prepare(self, trace: pa.Table, bs: int, vllm_cap: bool, cache):
        """The trace prepared for these options: from the trace cache when it holds it, else made (and stored)."""
        part = cache and cache.prepared_part(self.salt, self.share_lora_kv, vllm_cap)
        if cache is not None and (kept := cache.load_prepared(part)) is not None:
            return kept
        if cache is not None:
            trace = cache.with_block_hashes(trace)
        prep = prepare(trace, bs, use_salt=self.salt, share_lora=self.share_lora_kv, vllm_cap=vllm_cap)
        if cache is not None:
            cache.store_prepared(part, prep)
        return prep

    def replay_stream(self, scanned, progress=None) -> Iterator[StreamedPoint]:
        """The same points as `replay`, each answering the trace chunk by chunk (bounded memory): policies
        that can carry their cache across chunks, and the Belady bound with its next uses computed out of core
        first (`kvbench.cache.bound_stream`); when the scratch disk cannot hold them, the bound is left out and
        said to be (`Skipped`)."""
        if self.reference:
            raise KvbenchError("--reference needs the whole trace in memory; replay with --no-stream")
        pols = [_policies.get(n) for n in self.policies]
        blocked = [p.name for p in pols if p.carry is None and p.name != BOUND]
        if blocked:
            can = ", ".join(n for n, p in _policies.registry().items() if p.carry is not None or n == BOUND)
            raise KvbenchError(
                f"policy {', '.join(blocked)} needs the whole trace in memory; streamed replays "
                f"({scanned.block_references:,} block references) support {can}, or replay with --no-stream"
            )
        for pol in pols:
            self._check_needs(pol, scanned.filled)
        check_quota_tenants(self.policy_options, scanned.tenant_names)
        bs = scanned.meta.block_size
        caps = parse_capacities(self.capacity_spec, bs, self.model, self.kv_dtype) if self.capacity_spec else []
        for pol in pols:
            if pol.name != BOUND:
                for cap in caps:
                    yield _StreamedPoint(self, pol, cap, scanned)
        if self.curve:
            yield from self._streamed_curve(scanned, progress)
        if (caps and (BOUND in self.policies or self.bound)) or (self.curve and self.bound):
            yield from self._streamed_bound(scanned, caps, progress)

    def _streamed_bound(self, scanned, caps, progress) -> Iterator[StreamedPoint]:
        """The Belady points of a streamed replay: one pass computes the next uses onto scratch disk ($TMPDIR),
        which every capacity then reads chunk by chunk; the scratch files go when the last point is done. With
        --curve, also the capacities `_curves` gives the bound (from the distinct blocks the pass counts)."""
        from kvbench.cache.bound_stream import next_uses, spill_check
        from kvbench.cache.capacity import Capacity

        why = spill_check(scanned.block_references)
        if why is not None:
            yield Skipped(f"{BOUND} bound", f"{why}; or replay with --no-bound")
            return

        def report(done: int) -> None:
            if progress is not None:
                progress(Progress(done, scanned.block_references, f"{BOUND} bound: next uses"))

        with next_uses(scanned, use_salt=self.salt, share_lora=self.share_lora_kv, progress=report) as nu:
            for cap in caps:
                yield _StreamedBound(self, nu, cap, scanned)
            if self.curve and self.bound:
                for blocks in _curve_bound_blocks(nu.unique):
                    yield _StreamedBound(self, nu, Capacity(str(blocks), int(blocks)), scanned)

    def _streamed_curve(self, scanned, progress) -> Iterator[PointResult | Skipped]:
        """The lru curve of a streamed replay, read chunk by chunk with the LRU stack kept only as deep as the
        largest sampled capacity that fits `memory_budget` (`kvbench.cache.curve_stream`); the capacities
        beyond it are left out and said to be. A point with no columns: the runner writes no rows for it."""
        from kvbench.cache.curve_stream import BYTES_PER_DEPTH, StreamCurve, distinct_keys, memory_budget
        from kvbench.trace.stats import DEFAULT_WARMUP

        grid = _curve_grid(distinct_keys(scanned, self.salt, self.share_lora_kv))
        budget = memory_budget()
        run = StreamCurve(
            grid,
            min(int(grid[-1]), budget // BYTES_PER_DEPTH),
            n_requests=scanned.n_requests,
            warmup=DEFAULT_WARMUP,  # as lru_curve's
            block_size=scanned.meta.block_size,
            use_salt=self.salt,
            share_lora=self.share_lora_kv,
        )
        done = 0
        for chunk in scanned.chunks(columns=("input_tokens", "cache_salt", "lora")):
            run.feed(chunk)
            done += len(chunk.column("block_hashes").values)
            if progress is not None:
                progress(Progress(done, scanned.block_references, "lru curve"))
        yield PointResult(labels={"policy": "lru"}, extra={"curve": run.summary()})
        if run.grid.size < grid.size:
            need = BYTES_PER_DEPTH * int(grid[-1]) / 2**30
            yield Skipped(
                f"lru curve above {run.depth:,} blocks",
                f"a streamed curve keeps the LRU stack as deep as its largest capacity, up to {BYTES_PER_DEPTH} bytes "
                f"a block: {need:.1f} GiB for the trace's {int(grid[-1]):,} blocks, over the {budget / 2**30:.1f} GiB "
                f"it may take (half the available memory), so {grid.size - run.grid.size} of its {grid.size} "
                "capacities are left out; replay with --no-stream for them",
            )

    def _point(self, pol, prep, blocks: int, text: str) -> PointResult:
        run = pol.reference if self.reference else pol.kernel
        out = run(prep, blocks, self.policy_options)
        return PointResult(
            labels=_labels(pol, blocks),
            columns=_columns(out, prep),
            extra=_extra(out.evict_matrix, prep.tenant_names, out.filled_at, prep.n_requests, text),
        )

    def _curves(self, pols, prepared_for) -> Iterator[PointResult]:
        from kvbench.cache.curve import lru_curve

        for pol in pols:
            if not pol.stack:
                continue
            prep = prepared_for(pol.name)
            curve = lru_curve(prep)
            grid = _curve_grid(prep.n_keys)
            yield PointResult(labels={"policy": pol.name}, extra={"curve": curve.summary(grid)})
        if self.bound:
            prep = prepared_for(BOUND)
            for blocks in _curve_bound_blocks(prep.n_keys):
                yield self._point(_policies.get(BOUND), prep, int(blocks), str(blocks))


def _curve_grid(n_keys: int) -> np.ndarray:
    """The capacities at which --curve samples the lru curve: CURVE_POINTS, up to the trace's distinct blocks."""
    return np.unique(np.geomspace(1, max(n_keys, 2), CURVE_POINTS).astype(np.int64))


def _curve_bound_blocks(n_keys: int) -> np.ndarray:
    """The capacities at which --curve also runs the Belady bound: 8, up to the trace's distinct blocks."""
    return np.unique(np.geomspace(max(n_keys // 1000, 1), n_keys, 8).astype(np.int64))


def _labels(pol, blocks: int) -> dict:
    return {"policy": pol.name, "capacity_blocks": blocks}


def _columns(out: SimOutput, prep: PreparedTrace) -> dict[str, np.ndarray]:
    """The result columns of `out`, the answers to the requests of `prep` (a trace or a chunk of one)."""
    hit_tokens = np.minimum(out.hit_blocks.astype(np.int64) * prep.block_size, prep.input_tokens)
    if out.hit_tokens is not None:  # a policy that counts tokens (llama-slot with --vocab)
        hit_tokens = out.hit_tokens
    return {
        "hit_blocks": out.hit_blocks,
        "hit_tokens": hit_tokens,
        "hit_tokens_hbm": hit_tokens,
        "evictions": out.evictions,
    }


def _extra(evict_matrix: np.ndarray, tenant_names: list[str], filled_at: int, n_requests: int, text: str) -> dict:
    steady_from = int(n_requests * 0.5)
    return {
        "capacity": text,
        "evict_matrix": evict_matrix,
        "tenant_names": tenant_names,
        "filled_at_request": int(filled_at),
        # kvcache-simulator prints "underfilled" instead of a number; we keep the number and flag it
        "underfilled": bool(filled_at < 0 or filled_at >= steady_from),
    }


class _StreamedPoint:
    """A `kvbench.run.backend.StreamedPoint`: one policy at one capacity, answering a streamed trace."""

    def __init__(self, sim: SimBackend, pol, cap, scanned):
        from kvbench.cache.stream import StreamReplay  # compiles its kernels: only for streamed replays

        self.labels, self._text, self._n_requests = _labels(pol, cap.blocks), cap.text, scanned.n_requests
        self._run = StreamReplay(
            pol.carry,
            cap.blocks,
            block_size=scanned.meta.block_size,
            tenant_names=scanned.tenant_names,
            block_references=scanned.block_references,
            chunk_refs=scanned.chunk_refs,
            vllm_cap=pol.name == "vllm",  # vLLM recomputes at least the last prompt token
            use_salt=sim.salt,
            share_lora=sim.share_lora_kv,
        )

    def answer(self, chunk: pa.RecordBatch) -> dict[str, np.ndarray]:
        return _columns(*self._run.feed(chunk))

    def finish(self) -> dict:
        run = self._run
        return _extra(run.evict_matrix, run.tenant_names, run.filled_at, self._n_requests, self._text)


class _StreamedBound(_StreamedPoint):
    """The Belady bound at one capacity over a streamed trace, its next uses read from `nu`
    (`kvbench.cache.bound_stream`)."""

    def __init__(self, sim: SimBackend, nu, cap, scanned):
        from kvbench.cache.bound_stream import StreamBound

        self.labels, self._text, self._n_requests = (
            _labels(_policies.get(BOUND), cap.blocks),
            cap.text,
            scanned.n_requests,
        )
        self._run = StreamBound(
            nu,
            cap.blocks,
            block_size=scanned.meta.block_size,
            tenant_names=scanned.tenant_names,
            chunk_refs=scanned.chunk_refs,
            longest=scanned.longest,
            use_salt=sim.salt,
            share_lora=sim.share_lora_kv,
        )
