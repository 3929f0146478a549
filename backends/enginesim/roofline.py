"""Roofline latency of one continuous-batching iteration: the time the engine simulator's scheduler charges for a
step.

A step multiplies every token it processes (the new tokens of prefill chunks, one token per decode) through the
weights and attends over each sequence's cached context. It takes the larger of two bounds, compute (FLOPs over
the achieved FLOP/s, `mfu` of the datasheet peak) and memory (bytes through HBM over the achieved bandwidth, `mbu`
of the peak), plus the tensor-parallel all-reduces, which a plain TP engine runs between the layers' matmuls and
so does not hide behind either. A `Calibration` measured on a real engine (`kvbench calibrate`) replaces the
roofline with a sum of measured terms: a fixed cost per step and per request, costs per sequence, per token, per
attention pair and per KV token read (docs/fidelity.md).

Units: seconds, bytes, tokens; FLOP and FLOP/s for compute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

from kvbench.backends.enginesim import operators

from kvbench.errors import KvbenchError
from kvbench.models import KV_DTYPE_BYTES, Hardware, ModelGeometry

ACT_BYTES = 2  # activations travel as bf16 whatever the weight and KV formats: the all-reduce payload per value


@dataclass(frozen=True)
class Calibration:
    """A step-time model measured on a real engine (`kvbench calibrate`); with one, a step costs the *sum* of its
    terms instead of the roofline's max(compute, memory): on the engines calibrated here (a CPU, or a small model
    on any device) nothing in a step overlaps enough for a max to hold. Every term is in seconds and ≥ 0:

    request_overhead_s: once per request, outside the engine's step loop (HTTP, tokenising, the hand-off to the
        engine core, streaming the first token back): the request reaches the scheduler this much after it is sent.
    step_overhead_s: once per iteration (scheduling, input preparation, sampling set-up, kernel launches).
    s_per_seq: per sequence in the iteration (its sampling and output processing).
    s_per_token: per token the iteration runs through the model (new prefill tokens, one per decode).
    s_per_pair: per attention (query, key) pair: a prefill of N new tokens after P cached ones computes
        N·P + N(N+1)/2 of them, a decode of a sequence holding P tokens P + 1. What makes long prefills superlinear.
    s_per_kv_token: per cached KV token the iteration reads (the memory side of attention).
    join_window_s: not a step term: an idle engine's first step also takes the requests that reach it up to this
        long after the first (measured with pairs of requests sent a set offset apart,
        backends/enginesim/calibrate/joining.py).
        It is the last part of request_overhead_s, which a lone request's measured TTFT already holds: a request
        reaches the scheduler request_overhead_s − join_window_s after its send, and an idle instance starts its
        step join_window_s after the first arrival.
    """

    request_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    s_per_seq: float = 0.0
    s_per_token: float = 0.0
    s_per_pair: float = 0.0
    s_per_kv_token: float = 0.0
    join_window_s: float = 0.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and value >= 0 and value < float("inf")):
                raise KvbenchError(f"calibration: {f.name} must be a finite number ≥ 0, got {value!r}")
        if self.join_window_s > self.request_overhead_s:
            raise KvbenchError(
                f"calibration: join_window_s ({self.join_window_s:g} s) is part of request_overhead_s "
                f"({self.request_overhead_s:g} s) and cannot exceed it"
            )

    @classmethod
    def from_mapping(cls, data: dict, source: str) -> Calibration:
        """A calibration from a parsed file's table; `source` names the file."""
        known = [f.name for f in fields(cls)]
        values = {}
        for key, value in data.items():
            if key not in known:
                raise KvbenchError(f"{source}: unknown calibration key {key!r}; known keys: {', '.join(known)}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise KvbenchError(f"{source}: calibration {key} must be a number ≥ 0, got {value!r}")
            values[key] = float(value)
        try:
            return cls(**values)
        except KvbenchError as e:
            raise KvbenchError(f"{source}: {e}") from None

    def step_s(self, seqs: int, tokens: int, pairs: float, kv_read: float) -> float:
        """Seconds of one iteration of `seqs` sequences running `tokens` tokens through the model, computing
        `pairs` attention pairs and reading `kv_read` cached KV tokens (the request overhead is not a step's; it is
        `request_overhead_s`, paid before the scheduler). `kvbench calibrate` fits the terms to this sum: its rows
        are backends/enginesim/calibrate/design.py. A step with no tokens costs nothing."""
        if tokens == 0:
            return 0.0
        return (
            self.step_overhead_s
            + self.s_per_seq * seqs
            + self.s_per_token * tokens
            + self.s_per_pair * pairs
            + self.s_per_kv_token * kv_read
        )


class StepCost(NamedTuple):
    """One step's bounds, in seconds; the step takes `total`."""

    compute_s: float
    memory_s: float
    comm_s: float

    @property
    def total(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s


@dataclass(frozen=True)
class LatencyModel:
    """Step latencies of `model` served on `tp` devices of `hw`, per device (all devices run in lockstep).

    kv_dtype and weight_dtype are keys of KV_DTYPE_BYTES. mfu and mbu: achieved fractions of the datasheet
    FLOP/s and HBM bandwidth, in (0, 1].
    """

    model: ModelGeometry
    hw: Hardware
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    mfu: float = 0.5
    mbu: float = 0.8
    tp: int = 1
    calibration: Calibration | None = None

    def __post_init__(self):
        m = self.model
        for kind, dtype in (("KV", self.kv_dtype), ("weight", self.weight_dtype)):
            if dtype not in KV_DTYPE_BYTES:
                raise KvbenchError(f"unknown {kind} dtype {dtype!r}; choose one of: {', '.join(KV_DTYPE_BYTES)}")
        for key in ("mfu", "mbu"):
            if not 0 < getattr(self, key) <= 1:
                raise KvbenchError(f"{key} must be in (0, 1], got {getattr(self, key)!r}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise KvbenchError(f"tp must be a whole number ≥ 1, got {self.tp!r}")
        missing = [k for k in ("params", "heads") + (("hidden",) if self.tp > 1 else ()) if not getattr(m, k)]
        if missing:
            raise KvbenchError(
                f"model {m.name!r} lacks {', '.join(missing)} for latency modelling; set them in a [model.{m.name}] "
                "table of a specs file"
            )
        tp = self.tp
        # Derived once: the scheduler calls the step functions every iteration.
        derived = {
            "_kv_bytes": m.kv_bytes_per_token(self.kv_dtype),
            # TP splits KV heads across devices (replicating them past kv_heads ranks); MLA's single latent is
            # replicated on every rank, as vLLM does.
            "_kv_shards": 1 if m.mla else min(tp, m.kv_heads),
            "_weight_bytes": m.params * KV_DTYPE_BYTES[self.weight_dtype],
            "_active_fraction": m.active_params / m.params,
            "_linear_flops_per_token": 2 * m.active_params / tp,  # one multiply-add per active weight
            # QKᵀ and PV: 2 FLOPs per multiply-add, each over attn_head_dim, per query head, per layer
            "_attn_flops_per_pair": 4 * m.layers * m.heads * m.attn_head_dim / tp,
            # weight-only int4/fp4 formats dequantize to bf16; fp8 uses fp8 tensor cores where there are any
            "_linear_flops_s": self.hw.flops_for(self.weight_dtype) * self.mfu,
            # attention math runs in bf16 even over an fp8 KV cache (the kernels widen K and V on load)
            "_attn_flops_s": self.hw.flops * self.mfu,
            "_bytes_s": self.hw.hbm_bw * self.mbu,
            # two all-reduces of the hidden state per layer (after attention and after the MLP); a ring moves
            # 2(tp−1)/tp of the payload through each device's link
            "_comm_bytes_per_token": 2 * m.layers * m.hidden * ACT_BYTES * 2 * (tp - 1) / tp,
            # kernel by kernel where this device's kernels were measured (operators.py), else None: the roofline
            "_ops": None,
        }
        if self.calibration is None and operators.applies(m, self.hw, self.weight_dtype, tp):
            ops = operators.OperatorModel(m, self.hw, tp)
            fixed, per_token = ops.comm_terms()
            derived |= {"_ops": ops, "_attn_floor_s": m.layers * self.hw.eltwise_floor_s,
                        "_comm_fixed_s": fixed, "_comm_s_per_token": per_token}  # fmt: skip
        for key, value in derived.items():
            object.__setattr__(self, key, value)

    def step_terms(self) -> dict[str, float]:
        """The constants `_cost` computes a step from (derived in __post_init__), by name without the underscore:
        for a compiled copy of `_cost` (compiled_loop.py)."""
        return {key.removeprefix("_"): value for key, value in vars(self).items() if key.startswith("_")}

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token occupies across all layers and all TP ranks: what the cache tiers store and move."""
        return self._kv_bytes

    @property
    def weight_bytes(self) -> float:
        """Bytes of all weights, summed over the TP ranks."""
        return self._weight_bytes

    def kv_capacity_tokens(self, mem_util: float = 0.9) -> int:
        """Tokens of KV that fit in HBM beside the weights when the engine may use `mem_util` of each device (vLLM's
        --gpu-memory-utilization; activations and CUDA graphs are ignored)."""
        free = self.hw.hbm_bytes * mem_util - self._weight_bytes / self.tp
        if free <= 0:
            from kvbench.backends.enginesim.parallel import no_room_error  # (it imports this module)

            raise no_room_error(self, mem_util)  # names the smallest --tp / --pp / --weight-dtype that fits
        return int(free / (self._kv_bytes / self._kv_shards))

    def step_cost(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> StepCost:
        """The bounds of one iteration that runs the chunked-prefill pieces `prefills`, each (new tokens, tokens
        of context already cached before them), and one decode token for each sequence of `decode_contexts`
        (its cached tokens before this step)."""
        tokens = pairs = kv_read = kv_written = seqs = 0
        for new, context in prefills:
            if new < 0 or context < 0:
                raise ValueError(f"prefill piece ({new}, {context}): token counts must be ≥ 0")
            if new:
                seqs += 1
                tokens += new
                # causal: new token i attends the context and the new tokens up to itself
                pairs += new * context + new * (new + 1) / 2
                kv_read += context
                kv_written += new
        n, context = len(decode_contexts), sum(decode_contexts)
        return self._cost(tokens + n, pairs + context + n, kv_read + context, kv_written + n, seqs + n)

    def step_s(self, prefills: list[tuple[int, int]], decode_contexts: list[int]) -> float:
        """Seconds of one iteration; arguments as in `step_cost`."""
        return self.step_cost(prefills, decode_contexts).total

    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        """Seconds to prefill `new_tokens` after `context_tokens` already cached (the prefix hit), alone in a step."""
        return self.step_cost([(new_tokens, context_tokens)], []).total

    def decode_step_s(self, batch_size: int, batch_kv_tokens: int) -> float:
        """Seconds of a decode-only step: `batch_size` sequences holding `batch_kv_tokens` cached tokens in all."""
        if batch_size < 0 or batch_kv_tokens < 0:
            raise ValueError(f"decode step ({batch_size}, {batch_kv_tokens}): counts must be ≥ 0")
        n = batch_size
        return self._cost(n, batch_kv_tokens + n, batch_kv_tokens, n, n).total

    @staticmethod
    def transfer_s(n_bytes: float, bandwidth: float) -> float:
        """Seconds to move `n_bytes` at `bandwidth` bytes/s (e.g. hw.host_to_device_bw); link latency ignored."""
        if n_bytes < 0 or not bandwidth > 0:
            raise ValueError(f"transfer of {n_bytes} bytes at {bandwidth} bytes/s: need bytes ≥ 0, bandwidth > 0")
        return n_bytes / bandwidth

    @property
    def request_overhead_s(self) -> float:
        """Seconds between a request's send and its first step's earliest start (0 for the roofline)."""
        return self.calibration.request_overhead_s if self.calibration else 0.0

    @property
    def join_window_s(self) -> float:
        """Seconds an idle instance waits after its first arrival before it starts a step, taking what arrives
        meanwhile (Calibration.join_window_s; 0 for the roofline: the step starts at once)."""
        return self.calibration.join_window_s if self.calibration else 0.0

    def _cost(self, tokens: int, pairs: float, kv_read: int, kv_written: int, seqs: int) -> StepCost:
        # tokens: multiplied through the weights; pairs: (query, key) products of attention; kv_read / kv_written:
        # cached tokens a step's attention reads and new tokens whose K and V it stores; seqs: sequences in the step.
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0)
        if self._ops is not None:
            return self._operator_cost(tokens, pairs, kv_read, kv_written, seqs)
        comm = tokens * self._comm_bytes_per_token / self.hw.peer_bw if self.tp > 1 else 0.0
        if self.calibration is not None:  # measured terms, summed (the class says why)
            return StepCost(self.calibration.step_s(seqs, tokens, pairs, kv_read), 0.0, comm)
        compute = (
            tokens * self._linear_flops_per_token / self._linear_flops_s
            + pairs * self._attn_flops_per_pair / self._attn_flops_s
        )
        weights = self._weights_read(tokens) / self._bytes_s
        kv = (kv_read + kv_written) * (self._kv_bytes / self._kv_shards) / self._bytes_s
        return StepCost(compute, weights + kv, comm)

    def _operator_cost(self, tokens: int, pairs: float, kv_read: int, kv_written: int, seqs: int) -> StepCost:
        """The step kernel by kernel (operators.py): every layer's linear kernels at `tokens`, the logits GEMM over
        the step's sequences, attention's roofline (the measured files have no attention kernel) plus one kernel
        floor per layer, and the all-reduces. All of it is on the step's critical path, so `compute_s` holds
        the sum and `memory_s` is 0. compiled_loop._cost computes the same floats in the same order."""
        kv = (kv_read + kv_written) * (self._kv_bytes / self._kv_shards) / self._bytes_s
        attn = pairs * self._attn_flops_per_pair / self._attn_flops_s
        kernels = self._ops.linear_s(tokens) + self._ops.lm_head_s(seqs) + (self._attn_floor_s + max(attn, kv))
        return StepCost(kernels, 0.0, self._comm_fixed_s + tokens * self._comm_s_per_token)

    def _weights_read(self, tokens: int) -> float:
        """Weight bytes one device reads in a step of `tokens` tokens. Dense: all of them. MoE: each token routes
        to its active share; across a batch the experts touched grow as 1 − (1 − share)^tokens, so a single
        decode reads about the active weights and a large batch nearly all."""
        share = self._active_fraction
        touched = 1.0 if share >= 1.0 else 1.0 - (1.0 - share) ** tokens
        return self._weight_bytes * touched / self.tp
