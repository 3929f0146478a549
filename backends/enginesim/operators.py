"""Operator-level step time for hardware whose kernels were measured (a `Hardware` with `gemm_mfu` set, e.g. the
`h100` preset): what one transformer layer's kernels cost on a GPU, one by one, instead of the roofline's single
max(compute, memory) over the whole model.

A layer of a dense grouped-query model runs, for M tokens on each of `tp` devices (docs/gpu-truth.md):

- four GEMMs: the fused QKV projection (hidden → (heads + 2·kv_heads)·head_dim / tp), the output projection, the
  fused gate/up projection (hidden → 2·intermediate / tp) and the down projection. Each costs a kernel floor plus
  the larger of its memory time (weights and activations at `gemm_mbu` of the HBM bandwidth) and its compute
  time. Compute is counted in whole tiles: an M × N output is cut into tm × tn tiles, run in waves of one tile per
  SM, and cuBLAS is taken to pick the tile shape (of GEMM_TILES) that wastes least. That quantisation is why
  measured GEMM times step up just past multiples of 64 and 128 tokens;
- five memory-bound kernels: two RMS norms, rotary embedding, the gated activation and the residual add, each a
  floor plus its bytes at a kind-specific share of the bandwidth (reductions and rotations stream less well than
  an add);
- attention, which the measured files do not hold: its FLOPs and KV bytes as the roofline counts them
  (roofline.py), plus one kernel floor;
- with tp > 1, two all-reduces of the M × hidden bf16 activations: a fixed cost, a per-hop latency on each of a
  ring's 2(tp − 1) steps and the ring's 2(tp − 1)/tp share of the bytes at the bus bandwidth.

Once per step the logits GEMM runs over the sampled rows (one per sequence, as vLLM computes logits only at each
sequence's last position). The coefficients are fitted on measured H100 operator times by
benchmarks/gpu_truth.py; kvbench/models/hardware.py names the source.

Units: seconds, tokens, bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from kvbench.models import GEMM_TILES, Hardware, ModelGeometry

ACT_BYTES = 2  # bf16 activations and weights: the only formats the measured kernels ran in
ELTWISE_KINDS = ("norm", "rope", "act", "add")


def mlp_width(model: ModelGeometry) -> int:
    """The MLP's intermediate width: the model's own, or what its parameter count leaves after attention and
    (when the vocabulary is known) the untied embedding and lm_head, as gate, up and down matrices of
    hidden × width in every layer."""
    if model.intermediate:
        return model.intermediate
    attn = model.hidden * (2 * model.heads * model.attn_head_dim + 2 * model.kv_heads * model.head_dim)
    rest = model.params - model.layers * attn - 2 * model.vocab * model.hidden
    return max(0, rest // (3 * model.layers * model.hidden))


def applies(model: ModelGeometry, hw: Hardware, weight_dtype: str, tp: int) -> bool:
    """Whether the operator model covers this deployment: measured kernels on `hw`, a dense GQA model (MoE and
    MLA layers run other kernels) with its widths known, bf16 weights (the measured kernels' format), and a TP
    group inside one server (the all-reduces were measured over NVLink; wider groups cross the network, which
    parallel_model.py costs)."""
    dense = model.active_params == model.params and not model.mla
    inside = tp <= hw.devices_per_node
    return hw.has_operator_times and dense and weight_dtype == "bf16" and inside and bool(model.hidden and model.heads)


@dataclass(frozen=True)
class OperatorModel:
    """Kernel times of `model` on `tp` devices of `hw` (see the module docstring); build it only where `applies`."""

    model: ModelGeometry
    hw: Hardware
    tp: int = 1

    def __post_init__(self):
        m, tp = self.model, self.tp
        q, kv = m.heads * m.attn_head_dim, m.kv_heads * m.head_dim
        width = mlp_width(m)
        # (N, K) of each GEMM on one device: N output columns, K the reduced dimension
        gemms = {
            "qkv_proj": ((q + 2 * kv) // tp, m.hidden),
            "o_proj": (m.hidden, q // tp),
            "mlp_up": (2 * width // tp, m.hidden),
            "mlp_down": (m.hidden, width // tp),
        }
        # bytes per token each memory-bound kernel reads and writes, and its kind
        eltwise = {
            "input_norm": (2 * m.hidden * ACT_BYTES, "norm"),
            "post_attention_norm": (2 * m.hidden * ACT_BYTES, "norm"),
            "rope": (2 * (q + kv) // tp * ACT_BYTES, "rope"),  # q and k, read and written
            "mlp_act": (3 * width // tp * ACT_BYTES, "act"),  # gate and up in, their product out
            "add": (3 * m.hidden * ACT_BYTES, "add"),  # residual and output in, sum out
        }
        object.__setattr__(self, "gemms", gemms)
        object.__setattr__(self, "eltwise", eltwise)
        object.__setattr__(self, "lm_head", (m.vocab // tp, m.hidden) if m.vocab else None)

    def gemm_s(self, tokens: int, n: int, k: int) -> float:
        """One GEMM of a `tokens` × k activation by a k × n weight: floor + max(memory, tile-quantised compute)."""
        hw = self.hw
        if tokens == 0 or n == 0:
            return 0.0
        tiles = min(math.ceil(math.ceil(tokens / tm) * math.ceil(n / tn) / hw.sms) * tm * tn for tm, tn in GEMM_TILES)
        compute = tiles * 2 * k * hw.sms / (hw.flops * hw.gemm_mfu)
        memory = (tokens * k + k * n + tokens * n) * ACT_BYTES / (hw.hbm_bw * hw.gemm_mbu)
        return hw.gemm_floor_s + max(compute, memory)

    def eltwise_s(self, tokens: int, bytes_per_token: float, kind: str) -> float:
        """One memory-bound kernel over `tokens` tokens: floor + bytes at its kind's share of the bandwidth."""
        if tokens == 0:
            return 0.0
        return self.hw.eltwise_floor_s + tokens * bytes_per_token / (self.hw.hbm_bw * getattr(self.hw, f"{kind}_mbu"))

    def layer_ops_s(self, tokens: int) -> dict[str, float]:
        """Seconds of each linear-layer kernel of one layer at `tokens` tokens, by name (the module docstring)."""
        ops = {name: self.gemm_s(tokens, n, k) for name, (n, k) in self.gemms.items()}
        ops |= {name: self.eltwise_s(tokens, b, kind) for name, (b, kind) in self.eltwise.items()}
        return ops

    @lru_cache(maxsize=65536)  # noqa: B019 (the model is frozen and lives as long as its replay)
    def linear_s(self, tokens: int) -> float:
        """Seconds of every layer's linear work (GEMMs and memory-bound kernels) in a step of `tokens` tokens."""
        return self.model.layers * sum(self.layer_ops_s(tokens).values())

    @lru_cache(maxsize=4096)  # noqa: B019
    def lm_head_s(self, seqs: int) -> float:
        """Seconds of the logits GEMM over `seqs` sampled rows (0 when the vocabulary is unknown)."""
        return self.gemm_s(seqs, *self.lm_head) if self.lm_head and seqs else 0.0

    def all_reduce_s(self, n_bytes: float) -> float:
        """One all-reduce of `n_bytes` per device across the `tp` devices (0 on one device)."""
        n = self.tp
        if n == 1:
            return 0.0
        hw = self.hw
        return hw.collective_latency_s + 2 * (n - 1) * hw.link_latency_s + n_bytes * 2 * (n - 1) / n / hw.allreduce_bw

    def comm_terms(self) -> tuple[float, float]:
        """A step's all-reduce time as (fixed seconds, seconds per token): 2 per layer, each of tokens × hidden
        bf16 values, so that comm = fixed + tokens · per_token (the compiled loop uses the same two numbers)."""
        if self.tp == 1:
            return 0.0, 0.0
        calls = 2 * self.model.layers
        fixed = calls * self.all_reduce_s(0.0)
        per_token = calls * (self.all_reduce_s(self.model.hidden * ACT_BYTES) - self.all_reduce_s(0.0))
        return fixed, per_token
