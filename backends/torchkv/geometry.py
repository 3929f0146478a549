"""The shape of a paged KV cache in torch: the simulators' model geometry (kvbench.models.MODELS) plus what a
tensor needs on top of it, the element type, the tokens per block and the memory layout.

Two layouts, to A/B what offloading costs:

- `block_major`: `[blocks, layers, kv, block_tokens, kv_heads, head_dim]`. One block (every layer's K and V)
  is one contiguous run of bytes, so moving a block to the host or to disk is one copy (LMCache-style chunks).
- `layer_first`: `[layers, kv, blocks, block_tokens, kv_heads, head_dim]`, the way vLLM allocates one tensor
  per layer. A block is `layers × kv` separate pieces, so each block move is a strided gather.

`kv` is 2 (K and V) for ordinary attention and 1 for MLA, which caches one latent per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError
from kvbench.models import MODELS, ModelGeometry

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
LAYOUTS = ("block_major", "layer_first")


@dataclass(frozen=True)
class KvGeometry:
    model: ModelGeometry
    block_tokens: int
    dtype: str = "bf16"
    layout: str = "block_major"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise KvbenchError(f"KV dtype {self.dtype!r} is not one torch can hold here; choose {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise KvbenchError(f"layout {self.layout!r}: choose {' or '.join(LAYOUTS)}")
        if self.block_tokens < 1:
            raise KvbenchError(f"block size must be ≥ 1 token, got {self.block_tokens}")

    @classmethod
    def named(cls, model: str, block_tokens: int, dtype: str = "bf16", layout: str = "block_major") -> KvGeometry:
        if model not in MODELS:
            raise KvbenchError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
        return cls(MODELS[model], block_tokens, dtype, layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv(self) -> int:
        return 1 if self.model.mla else 2

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block in block-major order: `[layers, kv, block_tokens, kv_heads, head_dim]`."""
        m = self.model
        return (m.layers, self.kv, self.block_tokens, m.kv_heads, m.head_dim)

    def pool_shape(self, blocks: int, layout: str | None = None) -> tuple[int, ...]:
        layers, kv, *rest = self.block_shape
        if (layout or self.layout) == "block_major":
            return (blocks, layers, kv, *rest)
        return (layers, kv, blocks, *rest)

    @property
    def block_bytes(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.torch_dtype.itemsize


def block_dim(layout: str) -> int:
    """The axis of a pool tensor that indexes blocks."""
    return 0 if layout == "block_major" else 2


def layer_kv(pool: torch.Tensor, layout: str, layer: int) -> tuple[torch.Tensor, ...]:
    """Views of one layer's caches in a pool tensor, each `[blocks, block_tokens, kv_heads, head_dim]`: (K, V),
    or (latent,) for MLA. No copy."""
    per_layer = pool[:, layer] if layout == "block_major" else pool[layer]
    if layout == "block_major":
        return tuple(per_layer[:, i] for i in range(per_layer.shape[1]))
    return tuple(per_layer[i] for i in range(per_layer.shape[0]))
