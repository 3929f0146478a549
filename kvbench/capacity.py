"""Cache capacities as users say them (blocks, tokens or bytes) and the model geometry that converts them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import KvbenchError

KV_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5, "int4": 0.5, "int2": 0.25}


@dataclass(frozen=True)
class ModelGeometry:
    """What sets the KV bytes per token: K and V per layer, per KV head, per head dim (MLA: one latent)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    mla: bool = False  # DeepSeek MLA caches one compressed latent (no separate K and V) per layer

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> float:
        per_layer = self.kv_heads * self.head_dim * (1 if self.mla else 2)
        return self.layers * per_layer * KV_DTYPE_BYTES[kv_dtype]


# Published configs (config.json of each model on its hub page).
MODELS = {
    m.name: m
    for m in (
        ModelGeometry("llama3-8b", layers=32, kv_heads=8, head_dim=128),
        ModelGeometry("llama3-70b", layers=80, kv_heads=8, head_dim=128),
        ModelGeometry("llama3-405b", layers=126, kv_heads=8, head_dim=128),
        ModelGeometry("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        ModelGeometry("qwen2.5-72b", layers=80, kv_heads=8, head_dim=128),
        ModelGeometry("qwen3-8b", layers=36, kv_heads=8, head_dim=128),
        ModelGeometry("qwen3-32b", layers=64, kv_heads=8, head_dim=128),
        # kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token per layer
        ModelGeometry("deepseek-v3", layers=61, kv_heads=1, head_dim=576, mla=True),
        ModelGeometry("mistral-7b", layers=32, kv_heads=8, head_dim=128),
    )
}

_UNITS = {
    "": ("blocks", 1),
    "blk": ("blocks", 1),
    "block": ("blocks", 1),
    "blocks": ("blocks", 1),
    "tok": ("tokens", 1),
    "token": ("tokens", 1),
    "tokens": ("tokens", 1),
    "b": ("bytes", 1),
    "kb": ("bytes", 10**3),
    "mb": ("bytes", 10**6),
    "gb": ("bytes", 10**9),
    "tb": ("bytes", 10**12),
    "kib": ("bytes", 2**10),
    "mib": ("bytes", 2**20),
    "gib": ("bytes", 2**30),
    "tib": ("bytes", 2**40),
}
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Capacity:
    text: str  # as the user wrote it
    blocks: int

    def label(self) -> str:
        return str(self.blocks)


def parse_capacity(text: str, block_size: int, model: str | None = None, kv_dtype: str = "bf16") -> Capacity:
    """'10000' -> blocks; '5M tok' / '5000000 tokens' -> tokens; '40GiB' / '512 MB' -> bytes via the model.

    Tokens and bytes round down to whole blocks of `block_size` tokens.
    """
    m = _PATTERN.match(text.lower().replace("_", ""))
    if not m:
        raise KvbenchError(
            f"capacity {text!r} is not understood; write blocks (10000), tokens (5M tok) or bytes (40GiB)"
        )
    number, scale, unit = float(m.group(1)), m.group(2), m.group(3)
    if scale and scale + unit in _UNITS:  # '40gib' splits as ('g', 'ib')
        unit, scale = scale + unit, ""
    if unit not in _UNITS:
        raise KvbenchError(f"capacity {text!r}: unknown unit {unit!r}; use blocks, tok, B, KB/MB/GB or KiB/MiB/GiB")
    kind, factor = _UNITS[unit]
    value = number * _SCALE[scale] * factor
    if kind == "blocks":
        blocks = value
    elif kind == "tokens":
        blocks = value / block_size
    else:
        if model is None:
            raise KvbenchError(f"capacity {text!r} is in bytes: pass --model (one of {', '.join(MODELS)}) to convert")
        if model not in MODELS:
            raise KvbenchError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
        if kv_dtype not in KV_DTYPE_BYTES:
            raise KvbenchError(f"unknown KV dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPE_BYTES)}")
        blocks = value / (MODELS[model].kv_bytes_per_token(kv_dtype) * block_size)
    blocks = int(blocks)
    if blocks <= 0:
        raise KvbenchError(f"capacity {text!r} is less than one block of {block_size} tokens; it must be > 0")
    return Capacity(text.strip(), blocks)


def parse_capacities(spec: str, block_size: int, model: str | None = None, kv_dtype: str = "bf16") -> list[Capacity]:
    """A comma-separated list of capacities, each as `parse_capacity` reads it."""
    parts = [p for p in (s.strip() for s in spec.split(",")) if p]
    if not parts:
        raise KvbenchError("no capacity given; e.g. --capacity 10000 or --capacity 1000,3000,10000")
    return [parse_capacity(p, block_size, model, kv_dtype) for p in parts]
