"""One configuration point of the torch backend: a trace's requests, one at a time in arrival order, against
real block pools. Per request: the policy's lookup and admission (`store.BlockStore`), then the data the
bookkeeping implies: blocks found below HBM are loaded, new blocks are computed (real attention, `--compute`)
or filled, evicted ones are written down a tier, and the clock runs on each step."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from kvbench.backends.torchkv.geometry import KvGeometry
from kvbench.backends.torchkv.pools import DiskPool, TensorPool, checksums
from kvbench.backends.torchkv.store import HBM, BlockStore
from kvbench.backends.torchkv.transfers import Mover

from kvbench.run.backend import PointResult
from kvbench.trace.tokens import prompt_tokens

FILL_PATTERNS = 64  # distinct random blocks that stand in for computed KV when compute is off
VOCAB = 4096


@dataclass
class Settings:
    device: torch.device
    capacity: int  # HBM blocks
    dram: int
    ssd: int
    disk_dir: str
    disk_sync: bool
    write_through: bool
    copy_mode: str
    compute: bool
    decode_steps: int  # measured decode steps per request; 0 = every step
    verify: bool
    hardware: str | None = None  # datasheet for the transfer report's peaks (None: detect)


class Clock:
    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class PointReplay:
    def __init__(self, settings: Settings, geometry: KvGeometry, prep, trace, cache, progress=None):
        self.s, self.geometry, self.prep, self.trace, self.progress = settings, geometry, prep, trace, progress
        n_blocks = np.diff(prep.offsets)
        longest = int(n_blocks.max()) if n_blocks.size else 1
        self.store = BlockStore(cache, settings.capacity, settings.dram, settings.ssd, settings.write_through, longest)
        bs = prep.block_size
        out_tokens = trace.column("output_tokens").to_numpy().astype(np.int64)
        # scratch: a request's blocks the cache does not keep, and its decode blocks (one more for copy-on-write)
        self.scratch = (
            longest + 2 + (int((out_tokens.max() + bs - 1) // bs) if settings.compute and len(out_tokens) else 0)
        )
        hbm_slots = self.store.hbm.physical
        self.hbm = TensorPool(HBM, geometry, hbm_slots + self.scratch, settings.device, geometry.layout)
        self.hbm.data.zero_()
        cuda = settings.device.type == "cuda"
        self.pools = {HBM: self.hbm}
        if settings.dram:
            self.pools["dram"] = TensorPool(
                "dram", geometry, self.store.dram.slots.physical, torch.device("cpu"), "block_major", pin=cuda
            )
        if settings.ssd:
            self.pools["ssd"] = DiskPool(
                "ssd", geometry, self.store.ssd.slots.physical, settings.disk_dir, settings.disk_sync
            )
        self.scratch_slots = list(range(hbm_slots, hbm_slots + self.scratch))
        self.mover = Mover(settings.copy_mode, settings.device)
        self.clock = Clock(settings.device)
        gen = torch.Generator().manual_seed(0)
        bank = torch.randn((FILL_PATTERNS, *geometry.block_shape), generator=gen).to(geometry.torch_dtype)
        self.bank = bank.to(settings.device)
        self.bank_sums = checksums(self.bank).cpu() if settings.verify else None
        self.sums: dict[int, int] = {}  # key -> checksum of its data when produced (compute on, --verify)
        self.verify = {"checked": 0, "mismatches": 0}
        self.model = None
        if settings.compute:
            from kvbench.backends.torchkv.compute import PagedAttentionModel

            self.model = PagedAttentionModel(geometry, settings.device)

    # --- the run -----------------------------------------------------------------------------------------
    def run(self, labels: dict) -> PointResult:
        prep, n = self.prep, self.prep.n_requests
        cols = {k: np.zeros(n, np.int64) for k in ("hbm", "dram", "ssd", "prefill")}
        ttft, tpot, e2el = (np.full(n, np.nan) for _ in range(3))
        itl: list = [None] * n
        hashes = self.trace.column("block_hashes")
        inp = prep.input_tokens
        out_tokens = self.trace.column("output_tokens").to_numpy().astype(np.int64)
        try:
            for r in range(n):
                keys = prep.keys[prep.offsets[r] : prep.offsets[r + 1]].tolist()
                hit, plan = self.store.begin(r, keys, int(prep.max_hit[r]))
                cols["hbm"][r] = hit
                for tier in plan.found:
                    cols[tier][r] += 1
                table = self._block_table(plan)
                t0 = self.clock.now()
                self._load(plan, table.tolist(), keys)
                start = min((hit + len(plan.found)) * prep.block_size, int(inp[r]))
                if self.model is not None:
                    tokens = torch.as_tensor(
                        prompt_tokens(np.asarray(hashes[r].values), int(inp[r]), prep.block_size, VOCAB),
                        device=self.s.device,
                    )
                    before = self.model.computed_tokens
                    self.model.prefill(self.hbm.data, table, tokens, start)
                    cols["prefill"][r] = self.model.computed_tokens - before
                    ttft[r] = self.clock.now() - t0
                    steps = self._decode(table, int(inp[r]), int(out_tokens[r]), int(tokens[-1]))
                    tpot[r] = float(np.mean(steps)) if steps else np.nan
                    e2el[r] = ttft[r] + (tpot[r] * (out_tokens[r] - 1) if steps else 0.0)
                    if not self.s.decode_steps:
                        itl[r] = np.asarray(steps, dtype=np.float32)
                    self._record_sums(plan)
                else:
                    self._fill(plan)
                    cols["prefill"][r] = max(int(inp[r]) - start, 1)
                self._write_down(plan)
                self.store.end(r)
                if self.progress is not None and (r % 64 == 63 or r == n - 1):
                    self.progress(r + 1, n)
        finally:
            self.close()
        return self._result(labels, cols, ttft, tpot, e2el, itl, out_tokens)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.mover.close()

    # --- the steps -----------------------------------------------------------------------------------------
    def _block_table(self, plan) -> torch.Tensor:
        """The request's HBM slot per prompt block; blocks the cache does not keep go to scratch slots."""
        scratch = iter(self.scratch_slots)
        slots = [s if s is not None else next(scratch) for s in plan.table]
        self._next_scratch = sum(s is None for s in plan.table)
        return torch.tensor(slots, dtype=torch.int64, device=self.s.device)

    def _load(self, plan, table: list[int], keys: list[int]) -> None:
        """Blocks found below HBM into their slots, and hit blocks the admission moved into their new ones."""
        by_source: dict[str, tuple[list, list, list]] = defaultdict(lambda: ([], [], []))
        for pos, (tier, slot) in plan.loads:
            src, dst, ks = by_source[tier]
            src.append(slot)
            dst.append(table[pos])
            ks.append(keys[pos])
        for tier, (src, dst, ks) in by_source.items():
            self.mover.copy(f"{tier}->{HBM}", self.pools[tier], src, self.hbm, dst)
            if self.s.verify:
                self._check(ks, dst)
        if plan.refresh:
            dst, src = zip(*((slot, s) for slot, (_, s) in plan.refresh))
            self.mover.copy(f"{HBM}->{HBM}", self.hbm, list(src), self.hbm, list(dst))

    def _fill(self, plan) -> None:
        """Compute off: each new block gets its stand-in content, one batched write."""
        if not plan.produce:
            return
        keys = torch.tensor(list(plan.produce), dtype=torch.int64)
        slots = torch.tensor(list(plan.produce.values()), dtype=torch.int64, device=self.s.device)
        self.hbm.scatter(slots, self.bank.index_select(0, (keys % FILL_PATTERNS).to(self.s.device)))

    def _record_sums(self, plan) -> None:
        if self.s.verify and plan.produce:
            slots = torch.tensor(list(plan.produce.values()), dtype=torch.int64, device=self.s.device)
            for key, value in zip(plan.produce, checksums(self.hbm.gather(slots)).tolist()):
                self.sums[key] = value

    def _expected(self, key: int) -> int:
        return self.sums[key] if self.model is not None else int(self.bank_sums[key % FILL_PATTERNS])

    def _check(self, keys: list[int], hbm_slots: list[int]) -> None:
        got = checksums(self.hbm.gather(torch.tensor(hbm_slots, device=self.s.device))).tolist()
        self.verify["checked"] += len(keys)
        self.verify["mismatches"] += sum(g != self._expected(k) for k, g in zip(keys, got))

    def _write_down(self, plan) -> None:
        for tier in ("ssd", "dram"):  # any order is safe (see store.py); bottom first mirrors the spill chain
            by_source: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
            for _key, dst, (src_tier, src_slot) in plan.writes.get(tier, ()):
                by_source[src_tier][0].append(src_slot)
                by_source[src_tier][1].append(dst)
            for src_tier, (src, dst) in by_source.items():
                self.mover.copy(f"{src_tier}->{tier}", self.pools[src_tier], src, self.pools[tier], dst)

    def _decode(self, table: torch.Tensor, n_in: int, n_out: int, last_token: int) -> list[float]:
        """Decode steps 1..n_out-1 (the prefill gave the first token) into scratch blocks; the prompt's partial
        last block is copied first, since it may be a cached block other requests read. Returns the step
        times measured: every step, or `decode_steps` of them spread evenly over the output (the steps between
        are left out; their positions keep whatever the scratch held, which only the timing sees)."""
        if n_out <= 1:
            return []
        bs = self.geometry.block_tokens
        last = n_in + n_out - 2  # position of the last token fed
        blocks = table.tolist()[: n_in // bs]
        scratch = iter(self.scratch_slots[self._next_scratch :])
        if n_in % bs:
            cow = next(scratch)
            self.hbm.scatter(
                torch.tensor([cow], device=self.s.device), self.hbm.gather(table[n_in // bs : n_in // bs + 1])
            )
            blocks.append(cow)
        while len(blocks) * bs <= last:
            blocks.append(next(scratch))
        dtable = torch.tensor(blocks, dtype=torch.int64, device=self.s.device)
        positions = range(n_in, last + 1)
        if self.s.decode_steps and self.s.decode_steps < len(positions):
            positions = np.unique(np.linspace(n_in, last, self.s.decode_steps).astype(np.int64)).tolist()
        times = []
        token = last_token
        for p in positions:
            t0 = self.clock.now()
            self.model.decode(self.hbm.data, dtable, int(p), token)
            times.append(self.clock.now() - t0)
            token = (token * 31 + 7) % VOCAB  # the next input token: any id will do for timing
        return times

    # --- the answers ------------------------------------------------------------------------------------------
    def _result(self, labels, cols, ttft, tpot, e2el, itl, out_tokens) -> PointResult:
        from kvbench.backends.torchkv.bandwidth import hardware_for, transfer_report

        from kvbench.metrics.latency import modeled_latency_summary

        prep, bs = self.prep, self.prep.block_size
        inp = prep.input_tokens.astype(np.int64)

        def tokens(blocks):
            return np.minimum(blocks * bs, inp)

        hit_blocks = cols["hbm"] + cols["dram"] + cols["ssd"]
        out = self.store.cache.out
        columns = {
            "hit_blocks": hit_blocks,
            "hit_tokens": tokens(hit_blocks),
            "hit_tokens_hbm": tokens(cols["hbm"]),
            "hit_tokens_dram": tokens(cols["dram"]),
            "hit_tokens_ssd": tokens(cols["ssd"]),
            "evictions": out.evictions,
            "prefill_tokens": cols["prefill"],
            "status": np.full(prep.n_requests, "ok", dtype=object),
        }
        extra = {
            "evict_matrix": out.evict_matrix,
            "tenant_names": prep.tenant_names,
            "filled_at_request": int(out.filled_at),
            "torch": self._facts(cols),
        }
        if self.model is not None:
            n = prep.n_requests
            columns.update(ttft_s=ttft, tpot_s=tpot, e2el_s=e2el, itl_s=itl)
            tenants = [prep.tenant_names[t] for t in prep.tenant]
            summary = modeled_latency_summary(ttft, tpot, e2el, out_tokens, tenants, itl=itl)
            # requests run back to back, so throughput is over the sum of their times, not a wall span
            busy = float(np.nansum(e2el))
            summary["duration_s"] = busy
            summary["request_throughput"] = n / busy if busy else None
            summary["output_throughput"] = float(out_tokens.sum()) / busy if busy else None
            extra["latency"] = summary
        hw = hardware_for(self.s.device, self.s.hardware)
        extra["torch"]["transfers"] = transfer_report(self.mover.traffic, self.s.device, hw, self.s.disk_dir)
        return PointResult(labels=labels, columns=columns, extra=extra)

    def _facts(self, cols) -> dict:
        g = self.geometry
        facts = {
            "device": str(self.s.device),
            "model": g.model.name,
            "kv_dtype": g.dtype,
            "layout": g.layout,
            "block_tokens": g.block_tokens,
            "block_bytes": g.block_bytes,
            "copy_mode": self.s.copy_mode,
            "write_through": self.s.write_through,
            "pool_bytes": {name: pool.nbytes for name, pool in self.pools.items()},
            "blocks": {
                "hbm_hits": int(cols["hbm"].sum()),
                "dram_hits": int(cols["dram"].sum()),
                "ssd_hits": int(cols["ssd"].sum()),
                "evictions": int(self.store.cache.out.evictions.sum()),
                "written": {t.name: t.written for t in (self.store.dram, self.store.ssd) if t.capacity},
            },
            "prefill_tokens": int(cols["prefill"].sum()),
            "compute": self.model is not None,
            "decode_steps_per_request": self.s.decode_steps or "all",
        }
        if self.s.verify:
            facts["verify"] = dict(self.verify)
        return facts
