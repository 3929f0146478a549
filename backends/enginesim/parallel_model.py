"""The roofline of an instance made of many devices: tensor (tp), pipeline (pp) and expert (ep) parallelism and
data-parallel attention (dp_attention), per device, in seconds (docs/parallelism.md derives every term).

Layout. An instance has tp × pp devices: pp pipeline stages of tp devices each, stage s on devices s·tp …
(s + 1)·tp − 1, numbered server by server (`devices_per_node` of the hardware each). Within a stage:

- attention runs in dp_attention groups of tp / dp_attention devices: each group serves its own share of the
  requests, holds their KV and a full copy of the attention weights, split tp / dp_attention ways;
- dense MLPs, shared experts and embeddings are split tp ways;
- the routed experts of a MoE are spread over ep groups (ep divides tp), each expert split tp / ep ways. EP
  does not change the bytes per device (the same experts over the same devices); it swaps the MLP's
  all-reduce for an all-to-all and lets one group run hotter than the rest (`expert_imbalance`).

A step of N tokens is cut into m micro-batches (pp > 1 only); each stage's time on one micro-batch is the
one-device roofline (max of compute and memory) of its share of the layers plus its collectives; the step is
the pipeline's: pp stages and pp − 1 sends for the first micro-batch, then one bottleneck stage per further one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.backends.enginesim.roofline import ACT_BYTES, LatencyModel, StepCost

from kvbench.models import KV_DTYPE_BYTES, weight_split


def all_reduce_s(group: int, payload: float, bandwidth: float, hop_s: float) -> float:
    """A ring all-reduce of `payload` bytes among `group` devices: 2(n − 1) steps, each moving 1/n of the payload
    through every device's link (2(n − 1)/n of it in all) and paying one hop's latency."""
    if group <= 1 or payload <= 0:
        return 0.0
    return 2 * (group - 1) * hop_s + 2 * (group - 1) / group * payload / bandwidth


@dataclass(frozen=True)
class ParallelLatencyModel(LatencyModel):
    """LatencyModel's step costs and KV room for tp × pp devices (module docstring). `micro_batches` 0 means pp;
    `expert_imbalance` ≥ 1 is the busiest EP group's tokens over the mean. `option_prefix` ("decode-" for the
    decode pool of --disagg pd) is how the refusals name the options."""

    pp: int = 1
    ep: int = 1
    dp_attention: int = 1
    micro_batches: int = 0
    expert_imbalance: float = 1.0
    option_prefix: str = ""

    def __post_init__(self):
        super().__post_init__()
        from kvbench.backends.enginesim.parallel import check_layout  # (parallel imports this module)

        check_layout(self.model, self.tp, self.pp, self.ep, self.dp_attention, self.option_prefix)
        if (self.pp, self.ep, self.dp_attention) != (1, 1, 1):  # the kernel-by-kernel model is plain TP's only
            object.__setattr__(self, "_ops", None)
        m, tp, pp, dp = self.model, self.tp, self.pp, self.dp_attention
        split = weight_split(m)
        wb = KV_DTYPE_BYTES[self.weight_dtype]
        stage_layers = math.ceil(m.layers / pp)  # the busiest stage, when pp does not divide the layers
        f = stage_layers / m.layers
        attn_group = tp // dp
        routed = split.routed_expert_params
        routed_active = routed * split.experts_per_token / split.experts if split.moe else 0
        moe_layers = split.moe_layers if split.moe and self.ep > 1 else 0
        derived = {
            "_stage_fraction": f,
            "_stage_layers": stage_layers,
            "_attn_group": attn_group,
            "_kv_shards": 1 if m.mla else min(attn_group, m.kv_heads),
            # weights on one device of the busiest stage
            "_attn_bytes_dev": split.attention_params * wb * f / attn_group,
            "_rest_bytes_dev": (m.params - split.attention_params - routed) * wb * f / tp,
            "_expert_bytes_dev": routed * wb * f / tp,
            "_expert_share": split.experts_per_token / split.experts if split.moe else 0.0,
            "_dense_flops_per_token": 2 * (m.active_params - routed_active) * f / tp,
            "_expert_flops_per_token": 2 * routed_active * f / tp,
            "_attn_flops_per_pair": 4 * m.layers * m.heads * m.attn_head_dim * f / tp,
            "_hot": self.expert_imbalance if self.ep > 1 else 1.0,
            "_moe_layers": moe_layers,
            "_m": self.micro_batches or pp,
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)

    # --- memory ---------------------------------------------------------------------------------------------
    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def weight_bytes_per_device(self) -> float:
        """Weight bytes on one device of the busiest stage."""
        return self._attn_bytes_dev + self._rest_bytes_dev + self._expert_bytes_dev

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """KV bytes one token of a request occupies on each device that holds it (its stage's layers, its KV
        heads' shard; MLA's latent whole on every attention rank)."""
        return self._kv_bytes * self._stage_fraction / self._kv_shards

    def free_bytes_per_device(self, mem_util: float) -> float:
        return self.hw.hbm_bytes * mem_util - self.weight_bytes_per_device

    def capacity_tokens(self, mem_util: float) -> int:
        """KV tokens the instance holds (≤ 0 when the weights leave no room): each of the dp_attention groups
        fills its devices' free memory with its own requests' KV."""
        free = self.free_bytes_per_device(mem_util)
        if free <= 0:
            return 0
        return int(self.dp_attention * free / self.kv_bytes_per_token_per_device)

    def kv_capacity_tokens(self, mem_util: float = 0.9) -> int:
        tokens = self.capacity_tokens(mem_util)
        if tokens < 1:
            from kvbench.backends.enginesim.parallel import no_room_error

            raise no_room_error(self, mem_util)
        return tokens

    def transfer_s(self, n_bytes: float, bandwidth: float) -> float:
        """Seconds to move `n_bytes` of a request's KV to or from this instance when each device moves its own
        share over its own link of `bandwidth` (PCIe, NIC) at the same time: a 1/(shards · pp) share."""
        return LatencyModel.transfer_s(n_bytes, bandwidth) / (self._kv_shards * self.pp)

    # --- time -----------------------------------------------------------------------------------------------
    def _link(self, group: int) -> tuple[float, float]:
        """(bytes/s, hop latency) of a collective among `group` consecutive devices: NVLink within a server,
        the network when the group spans servers (a ring is as fast as its slowest link)."""
        hw = self.hw
        if group <= hw.devices_per_node:
            return hw.peer_bw, hw.link_latency_s
        return min(hw.net_bw, hw.peer_bw), hw.net_latency_s

    def _collectives_s(self, tokens: float) -> float:
        """One stage's collectives for `tokens` tokens, per device: attention's all-reduce in its group, then the
        MLP's all-reduce over tp (dense layers, or experts split tp ways) or the MoE all-to-all (ep > 1)."""
        m, tp, ep, dp = self.model, self.tp, self.ep, self.dp_attention
        row = m.hidden * ACT_BYTES  # one token's activations
        attn = all_reduce_s(self._attn_group, tokens / dp * row, *self._link(self._attn_group))
        mlp = all_reduce_s(tp, tokens * row, *self._link(tp))
        moe = 0.0
        if self._moe_layers:
            bw, hop = self._link(tp)
            k = weight_split(m).experts_per_token
            # dispatch and combine: each device's 1/tp of the tokens sends k copies, (ep − 1)/ep of them to
            # another group; the busiest group receives `_hot` times the mean
            sent = tokens / tp * k * row * (ep - 1) / ep * self._hot
            moe = 2 * (hop + sent / bw)
            moe += all_reduce_s(tp // ep, tokens * k / ep * self._hot * row, *self._link(tp // ep))
        per_stage = self._stage_fraction
        dense_layers = m.layers - self._moe_layers
        return per_stage * (m.layers * attn + dense_layers * mlp + self._moe_layers * moe)

    def _send_s(self, tokens: float) -> list[float]:
        """Seconds of each stage-to-stage send of `tokens` tokens' activations (each tp rank sends its 1/tp slice);
        a boundary whose ranks sit on different servers goes over the network."""
        out, node = [], self.hw.devices_per_node
        payload = tokens * self.model.hidden * ACT_BYTES / self.tp
        for s in range(1, self.pp):
            tp = self.tp
            crosses = any(((s - 1) * tp + r) // node != (s * tp + r) // node for r in range(tp))
            bw, hop = (min(self.hw.net_bw, self.hw.peer_bw), self.hw.net_latency_s) if crosses else self._link(1)
            out.append(hop + payload / bw)
        return out

    def _stage(self, tokens, pairs, kv_moved) -> tuple[float, float, float]:
        """(compute, memory, collectives) of one stage on one micro-batch, per device."""
        compute = (
            tokens * (self._dense_flops_per_token + self._expert_flops_per_token * self._hot) / self._linear_flops_s
            + pairs * self._attn_flops_per_pair / self._attn_flops_s
        )
        memory = (self._weights_read(tokens) + kv_moved * self._kv_bytes_moved_per_token()) / self._bytes_s
        return compute, memory, self._collectives_s(tokens)

    def _kv_bytes_moved_per_token(self) -> float:
        # a device reads the KV of its own attention group's requests, 1/dp_attention of the step's
        return self.kv_bytes_per_token_per_device / self.dp_attention

    def _weights_read(self, tokens: float) -> float:
        """Weight bytes one device reads for a micro-batch of `tokens`: attention and dense weights whole; of its
        experts the share the batch routes to, 1 − (1 − k/E)^tokens, times the busiest group's excess. A MoE
        without a WeightSplit entry falls back on the one-device rule (roofline.LatencyModel._weights_read)."""
        fixed = self._attn_bytes_dev + self._rest_bytes_dev
        if self._expert_share:
            touched = min(1.0, (1.0 - (1.0 - self._expert_share) ** tokens) * self._hot)
            return fixed + self._expert_bytes_dev * touched
        share = self._active_fraction
        return fixed * (1.0 if share >= 1.0 else 1.0 - (1.0 - share) ** tokens)

    def _cost(self, tokens, pairs, kv_read, kv_written, seqs) -> StepCost:
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0)
        if self.calibration is not None or self._ops is not None:  # (a calibration is refused by parallel.resolve)
            return super()._cost(tokens, pairs, kv_read, kv_written, seqs)
        m = 1 if self.pp == 1 else max(1, min(self._m, seqs))
        compute, memory, coll = self._stage(tokens / m, pairs / m, (kv_read + kv_written) / m)
        stage = max(compute, memory) + coll
        sends = self._send_s(tokens / m)
        total = self.pp * stage + sum(sends) + (m - 1) * max([stage, *sends])
        k = self.pp + m - 1  # stage runs on the critical path
        return StepCost(k * compute, k * memory, total - k * max(compute, memory))

    def bubble_share(self, seqs: int) -> float:
        """Share of a pipelined step a stage sits idle (fill and drain): (pp − 1)/(m + pp − 1)."""
        m = 1 if self.pp == 1 else max(1, min(self._m, seqs))
        return (self.pp - 1) / (m + self.pp - 1)
