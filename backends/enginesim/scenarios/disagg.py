"""Disaggregated serving. `pd`: the first `--prefill-instances` instances only prefill; a prefilled request's KV
crosses a link of `--kv-link-gbps` to the least-loaded decode instance, which produces every output token (the
transfer is in TTFT and in the tier traffic). `attn-ffn` (a research what-if, e.g. MegaScale-Infer): attention
and FFN on different pools, so each decode step sends the activations across the link twice per layer; the
run is modeled as aggregated and the report gives the added latency and bytes beside the KV traffic that
keeping KV with the attention pool saves compared with `pd`."""

from __future__ import annotations

import click

from kvbench.errors import KvbenchError

from . import Scenario, scenario

HOP_S = 5e-6  # one-way latency of a link crossing (RDMA-class fabric), per crossing


@scenario
class Disaggregation(Scenario):
    name = "disagg"
    options = [
        click.Option(
            ["--disagg"],
            type=click.Choice(["pd", "attn-ffn"]),
            help="pd: separate prefill and decode instances; attn-ffn: report the cost of splitting attention from FFN",
            default=None,
        ),
        click.Option(
            ["--prefill-instances"],
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="pd: instances that only prefill (the rest decode)",
        ),
        click.Option(
            ["--kv-link-gbps"],
            type=click.FloatRange(min=0, min_open=True),
            default=50.0,
            show_default=True,
            help="link between the pools (GB/s): KV for pd, activations for attn-ffn",
        ),
    ]

    def __init__(self, mode: str, n_prefill: int, link_bw: float):
        self.mode, self.n_prefill, self.link_bw = mode, n_prefill, link_bw
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
        return cls(mode, settings["prefill_instances"], settings["kv_link_gbps"] * 1e9)

    def attach(self, instances, reqs, trace, prep, block_size):
        self.latency = instances[0].latency
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

    def summary(self, reqs, instances, prep, kv_bytes_block):
        if self.mode == "pd":
            return {
                "mode": "pd",
                "prefill_instances": self.n_prefill,
                "kv_bytes_transferred": self.kv_bytes,
                "link_gbps": self.link_bw / 1e9,
            }
        m = self.latency.model
        act = 2 * m.layers * m.hidden * 2  # bytes per decoded token: to the FFN pool and back, every layer, bf16
        tokens = sum(max(0, r.generated - 1) for r in reqs)
        per_token_s = 2 * m.layers * HOP_S + act / self.link_bw
        kv_pd = sum(r.n_in for r in reqs) * self.latency.kv_bytes_per_token
        return {
            "mode": "attn-ffn",
            "activation_bytes": act * tokens,
            "added_latency_per_token_s": per_token_s,
            "added_tpot_share": per_token_s / max(1e-12, _median_tpot(reqs)),
            "kv_bytes_not_moved_vs_pd": kv_pd,
        }


def _median_tpot(reqs) -> float:
    import numpy as np

    tpot = [(r.finish - r.first_token) / (r.n_out - 1) for r in reqs if r.n_out > 1 and r.finish >= 0]
    return float(np.median(tpot)) if tpot else 0.0
