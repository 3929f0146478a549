"""Disaggregated serving.

`pd`: the first `--prefill-instances` instances only prefill; a prefilled request's KV crosses a link of
`--kv-link-gbps` to the least-loaded decode instance, which produces every output token (the transfer is in
TTFT and in the tier traffic).

`attn-ffn` (a research what-if, e.g. MegaScale-Infer): attention and FFN run on different devices, so in every
iteration each token's activations cross the link twice per layer (to the FFN device and back, bf16). Each
instance stands for one attention + FFN pair; KV stays with attention, so none moves as in `pd`. Run one after
the other, an iteration of N tokens (prefill tokens + one per decoding sequence) takes

    T_serial = T + 2·L·(h + N·H·2 / B)

T the aggregated roofline step, L layers, H the hidden width, B the link (bytes/s), h the one-way latency of a
crossing (HOP_S). This is what every step, and so TTFT and TPOT, gains over the aggregated run.

`attn-ffn-pipelined`: the step's tokens are split into m = min(--attn-ffn-micro-batches, N) micro-batches
that chase each other around the ring attention → link → FFN → link, layer after layer, so the two devices and
the link work at the same time on different micro-batches (MegaScale-Infer's ping-pong pipeline). Per layer
and micro-batch the stages take

    a = (T − W(N)) / (L·m) + s·W(N/m) / L     attention: its math and KV traffic, plus the Q/K/V/O projections
    f = (1 − s)·W(N/m) / L                     FFN (and the rest of the linear layers)
    c = h + (N/m)·H·2 / B                      one crossing

W(n) = the roofline's time for n tokens through the weights with no context (`decode_step_s(n, 0)`), s the
attention projections' share of the active parameters. A micro-batch reads the weights again, so W(N/m) does
not shrink with m when decode is memory-bound: more micro-batches cost weight reads. With r = a + f + 2c (one
round trip) and b = max(a, f, c) (the bottleneck), the m·L (micro-batch, layer) rounds take

    T_pipe = max(m·L·b + (r − b),  L·r + (m − 1)·b)

the first term when there are enough micro-batches to keep the bottleneck busy (m·b ≥ r: it runs m·L rounds
back to back, plus the fill and drain of the other stages, r − b), the second when there are not (each
micro-batch runs its L round trips, the last one starts (m − 1)·b after the first). With m = 1 both give
L·r = T_serial. The pipeline may beat the aggregated T (the devices overlap) or not (weight re-reads,
a slow link); the step takes T_pipe either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import click
import numpy as np
from kvbench.backends.enginesim.scenarios import Scenario, scenario

from kvbench.errors import KvbenchError
from kvbench.options import cli_options, option

HOP_S = 5e-6  # one-way latency of a link crossing (RDMA-class fabric), per crossing
ACT_BYTES = 2  # activations cross as bf16


def pipeline_s(a: float, f: float, c: float, layers: int, micro_batches: int) -> float:
    """Seconds for `micro_batches` micro-batches to each run `layers` rounds of attention (a), link (c), FFN
    (f), link (c), the stages working concurrently on different micro-batches (formula: module docstring)."""
    m, b, r = micro_batches, max(a, f, c), a + f + 2 * c
    return max(m * layers * b + (r - b), layers * r + (m - 1) * b)


def attention_share(model) -> float:
    """Share of the active parameters in the attention projections (Q and O: H × heads·head_dim each; K and V:
    H × kv_heads·head_dim each, every layer); the rest runs on the FFN device."""
    per_layer = model.hidden * (2 * model.heads * model.attn_head_dim + 2 * model.kv_heads * model.head_dim)
    return min(1.0, model.layers * per_layer / model.active_params) if model.active_params else 0.0


@dataclass(frozen=True)
class DisaggregationOptions:
    """The engine-sim options of the Disaggregation scenario."""

    disagg: str | None = option(
        None,
        "pd: separate prefill and decode instances; attn-ffn: attention and FFN on separate devices, "
        "activations cross the link every layer of every step (added to TTFT/TPOT); attn-ffn-pipelined: "
        "the same with micro-batches pipelined layer by layer",
        unit="name",
        type=click.Choice(["pd", "attn-ffn", "attn-ffn-pipelined"]),
    )
    prefill_instances: int = option(
        1,
        "pd: instances that only prefill (the rest decode)",
        unit="instances",
        type=click.IntRange(min=1),
    )
    kv_link_gbps: float = option(
        50.0,
        "link between the pools (GB/s): KV for pd, activations for attn-ffn",
        unit="GB/s, 1e9 bytes/s",
        type=click.FloatRange(min=0, min_open=True),
    )
    attn_ffn_micro_batches: int = option(
        2,
        "attn-ffn-pipelined: micro-batches per iteration (count; 2 = ping-pong), at most one per token",
        unit="micro-batches",
        type=click.IntRange(min=1),
    )


@scenario
class Disaggregation(Scenario):
    name = "disagg"
    options = cli_options(DisaggregationOptions)

    def __init__(self, mode: str, n_prefill: int, link_bw: float, micro_batches: int = 2):
        self.mode, self.n_prefill, self.link_bw, self.micro_batches = mode, n_prefill, link_bw, micro_batches
        self.kv_bytes = 0.0

    @classmethod
    def create(cls, settings):
        mode = settings.get("disagg")
        if mode is None:
            return None
        if mode == "pd" and settings["prefill_instances"] >= settings["instances"]:
            raise KvbenchError(
                f"--disagg pd needs more --instances than --prefill-instances ({settings['prefill_instances']})"
            )
        micro = int(settings.get("attn_ffn_micro_batches") or 2)
        return cls(mode, settings["prefill_instances"], settings["kv_link_gbps"] * 1e9, micro)

    def attach(self, instances, reqs, trace, prep, block_size):
        self.latency = instances[0].latency
        m = self.latency.model
        if self.mode != "pd" and not m.hidden:
            raise KvbenchError(f"--disagg {self.mode} needs the model's hidden width; {m.name} has none")
        self.act_bytes_per_token = 2 * m.layers * m.hidden * ACT_BYTES  # to the FFN device and back, every layer
        self.attn_share = attention_share(m)
        if self.mode == "pd":
            for inst in instances:
                inst.role = "prefill" if inst.index < self.n_prefill else "decode"
            self.pools = (instances[: self.n_prefill], instances[self.n_prefill :])

    def candidates(self, instances, req, t):
        if self.mode != "pd":
            return instances
        pool = self.pools[1] if req.handoff else self.pools[0]
        return [i for i in instances if i in pool] or pool

    def handoff_s(self, req):
        n = req.context * self.latency.kv_bytes_per_token
        self.kv_bytes += n
        return self.latency.transfer_s(n, self.link_bw) + HOP_S

    # --- attention / FFN split --------------------------------------------------------------------------------
    def transfer_s(self, tokens: float) -> float:
        """Seconds an unpipelined iteration of `tokens` tokens spends on the link: 2 crossings per layer."""
        if tokens <= 0:
            return 0.0
        return 2 * self.latency.model.layers * HOP_S + tokens * self.act_bytes_per_token / self.link_bw

    def step_extra_s(self, inst, prefills, decode_contexts):
        if self.mode == "pd":
            return 0.0
        tokens = sum(new for new, _ in prefills) + len(decode_contexts)
        if self.mode == "attn-ffn" or tokens <= 0:
            return self.transfer_s(tokens)
        aggregated = self.latency.step_s(prefills, decode_contexts)
        return self.pipelined_step_s(aggregated, tokens) - aggregated

    def pipelined_step_s(self, aggregated: float, tokens: float) -> float:
        """T_pipe of an iteration of `tokens` tokens whose aggregated roofline time is `aggregated`."""
        lat, layers = self.latency, self.latency.model.layers
        m = max(1, min(self.micro_batches, int(tokens)))
        weights_all, weights_micro = lat.decode_step_s(tokens, 0), lat.decode_step_s(tokens / m, 0)
        attention = max(0.0, aggregated - weights_all)  # what attention adds to a step beyond the weights
        a = attention / (layers * m) + self.attn_share * weights_micro / layers
        f = (1 - self.attn_share) * weights_micro / layers
        c = HOP_S + (tokens / m) * self.act_bytes_per_token / (2 * layers) / self.link_bw
        return pipeline_s(a, f, c, layers, m)

    def summary(self, reqs, instances, prep, kv_bytes_block):
        if self.mode == "pd":
            return {
                "mode": "pd",
                "prefill_instances": self.n_prefill,
                "kv_bytes_transferred": self.kv_bytes,
                "link_gbps": self.link_bw / 1e9,
            }
        # every token a step runs crosses: prefilled ones (recomputed included) and one per decode step
        bs = prep.block_size
        prefilled = sum(max(0, r.n_in - sum(r.hit.values()) * bs) for r in reqs if r.hit is not None)
        tokens = prefilled + sum(r.recomputed + max(0, r.generated - 1) for r in reqs)
        per_token_s = self.transfer_s(1)  # one decoding sequence alone: its TPOT grows by this (attn-ffn)
        out = {
            "mode": self.mode,
            "activation_bytes": self.act_bytes_per_token * tokens,
            "added_latency_per_token_s": per_token_s,
            "added_tpot_share": per_token_s / max(1e-12, _median_tpot(reqs)),
            "kv_bytes_not_moved_vs_pd": sum(r.n_in for r in reqs) * self.latency.kv_bytes_per_token,
            "link_gbps": self.link_bw / 1e9,
        }
        if self.mode == "attn-ffn-pipelined":
            out["micro_batches"] = self.micro_batches
            out["attention_param_share"] = self.attn_share
        return out


def _median_tpot(reqs) -> float:
    tpot = [(r.finish - r.first_token) / (r.n_out - 1) for r in reqs if r.n_out > 1 and r.finish >= 0]
    return float(np.median(tpot)) if tpot else 0.0
