"""Attention/FFN disaggregation on multi-device deployments (MegaScale-Infer's layout): `attention_devices`
devices each hold a copy of the attention weights and the KV of their own sequences (data-parallel attention);
`ffn_devices` devices hold the rest of the weights, split among them (experts spread as in EP, dense MLPs
split as in TP); every layer, each micro-batch's activations cross the link to the FFN side and back.

A decode step of B sequences per attention device at context C, in m micro-batches that ping-pong through the
layers (scenarios/disagg.py `pipeline_s`), takes per layer and micro-batch

    a = max(attention FLOPs, attention weights + B/m·C KV bytes per layer) on one attention device
    f = max(FFN FLOPs, FFN weights touched) on the busiest FFN device, plus a dense FFN's all-reduce
    c = hop + the larger of one attention device's send (B/m·k·H·2) and one FFN device's receive

and the step, one token for each of the n_a·B sequences, is TPOT; tokens/s per device = n_a·B / TPOT /
(n_a + n_f). docs/parallelism.md has the assumptions. Units: seconds, bytes, tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.backends.enginesim.parallel_model import all_reduce_s
from kvbench.backends.enginesim.roofline import ACT_BYTES
from kvbench.backends.enginesim.scenarios.disagg import HOP_S, pipeline_s

from kvbench.errors import KvbenchError
from kvbench.models import KV_DTYPE_BYTES, weight_split


@dataclass(frozen=True)
class AfdDeployment:
    """One attention/FFN-disaggregated instance. link_bw: bytes/s one way per device between the two sides
    (0: NVLink when both sides fit one server, the network otherwise). max_batch: sequences one attention device
    runs at most (its KV may allow fewer)."""

    model: object
    hw: object
    attention_devices: int
    ffn_devices: int
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    mfu: float = 0.5
    mbu: float = 0.8
    micro_batches: int = 2
    expert_imbalance: float = 1.0
    link_bw: float = 0.0
    mem_util: float = 0.9
    max_batch: int = 256

    def __post_init__(self):
        m, split = self.model, weight_split(self.model)
        wb = KV_DTYPE_BYTES[self.weight_dtype]
        if self.attention_devices < 1 or self.ffn_devices < 1:
            raise KvbenchError("attention/FFN split: need at least one attention device and one FFN device")
        ffn_params = m.params - split.attention_params
        usable = self.hw.hbm_bytes * self.mem_util
        if ffn_params * wb / self.ffn_devices > usable:
            need = math.ceil(ffn_params * wb / usable)
            raise KvbenchError(
                f"{m.name}: {ffn_params * wb / 1e9:.0f} GB of FFN/expert weights do not fit on {self.ffn_devices} "
                f"FFN devices of {self.hw.name}; the smallest FFN device count that fits is {need}"
            )
        routed_active = split.routed_expert_params * split.experts_per_token / split.experts if split.moe else 0
        same_server = self.attention_devices + self.ffn_devices <= self.hw.devices_per_node
        values = {
            "_attn_bytes": split.attention_params * wb,
            "_ffn_bytes_dev": ffn_params * wb / self.ffn_devices,
            "_expert_bytes_dev": split.routed_expert_params * wb / self.ffn_devices,
            "_attn_flops_tok": 2 * split.attention_params,
            "_ffn_dense_flops_tok": 2 * max(0, m.active_params - split.attention_params - routed_active),
            "_ffn_expert_flops_tok": 2 * routed_active,
            "_k": split.experts_per_token if split.moe else 1,
            "_share": split.experts_per_token / split.experts if split.moe else 0.0,
            "_link": self.link_bw or (self.hw.peer_bw if same_server else min(self.hw.net_bw, self.hw.peer_bw)),
            "_hop": self.hw.link_latency_s if same_server else HOP_S,
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @property
    def devices(self) -> int:
        return self.attention_devices + self.ffn_devices

    def kv_tokens_per_attention_device(self) -> int:
        free = self.hw.hbm_bytes * self.mem_util - self._attn_bytes
        return max(0, int(free / self.model.kv_bytes_per_token(self.kv_dtype)))

    def batch(self, context: int) -> int:
        """Sequences one attention device runs at `context` tokens each: what its KV holds, at most max_batch."""
        return min(self.max_batch, self.kv_tokens_per_attention_device() // max(1, context))

    def decode_step_s(self, batch: int, context: int) -> tuple[float, dict]:
        """(seconds of one decode step, its per-layer stage times) for `batch` sequences per attention device."""
        m, L = self.model, self.model.layers
        mb = max(1, min(self.micro_batches, batch))
        per_mb = batch / mb  # sequences of one micro-batch on one attention device
        tokens_ffn = per_mb * self.attention_devices  # tokens of one micro-batch reaching the FFN side
        flops_s, bytes_s = self.hw.flops_for(self.weight_dtype) * self.mfu, self.hw.hbm_bw * self.mbu
        attn_flops_s = self.hw.flops * self.mfu
        kv_layer = self.model.kv_bytes_per_token(self.kv_dtype) / L
        pair_flops = 4 * m.heads * m.attn_head_dim  # QKᵀ and PV per (query, key) pair, per layer
        a = max(
            per_mb * self._attn_flops_tok / L / flops_s + per_mb * (context + 1) * pair_flops / attn_flops_s,
            (self._attn_bytes / L + per_mb * (context + 1) * kv_layer) / bytes_s,
        )
        hot = self.expert_imbalance if self._share else 1.0
        touched = min(1.0, (1 - (1 - self._share) ** tokens_ffn) * hot) if self._share else 1.0
        ffn_read = self._ffn_bytes_dev - self._expert_bytes_dev * (1 - touched)
        ffn_flops = tokens_ffn * (self._ffn_dense_flops_tok + self._ffn_expert_flops_tok * hot) / self.ffn_devices
        f = max(ffn_flops / L / flops_s, ffn_read / L / bytes_s)
        row = m.hidden * ACT_BYTES
        if not self._share:  # a dense MLP split n_f ways sums its partial outputs
            f += all_reduce_s(self.ffn_devices, tokens_ffn * row, self._link, self._hop)
        sent = per_mb * self._k * row  # one attention device's tokens, to k experts each
        received = tokens_ffn * self._k * row / self.ffn_devices * hot if self._share else tokens_ffn * row
        c = self._hop + max(sent, received) / self._link
        return pipeline_s(a, f, c, L, mb), {"attention_s": a, "ffn_s": f, "link_s": c, "micro_batches": mb}

    def point(self, context: int) -> dict:
        """The curve's point at this split: batch, TPOT, tokens/s per device and where the time goes."""
        batch = self.batch(context)
        if batch < 1:
            return {"attention_devices": self.attention_devices, "ffn_devices": self.ffn_devices, "fits": False}
        step, stages = self.decode_step_s(batch, context)
        tokens = batch * self.attention_devices
        return {
            "attention_devices": self.attention_devices,
            "ffn_devices": self.ffn_devices,
            "ratio": self.attention_devices / self.ffn_devices,
            "fits": True,
            "batch_per_attention_device": batch,
            "tpot_ms": step * 1e3,
            "tokens_per_s": tokens / step,
            "tokens_per_s_per_device": tokens / step / self.devices,
            "bottleneck": max(("attention", "ffn", "link"), key=lambda k: stages[k + "_s"]),
            **{k: v * 1e3 if k.endswith("_s") else v for k, v in stages.items()},
        }
