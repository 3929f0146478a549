"""Group-wise KV-cache quantizers in plain torch, and the bytes they cost per token (docs/kv-quantization.md).

Every format quantizes a tensor in groups of `group` consecutive elements along one axis and stores, per group,
what it needs to dequantize, in fp16 (2 bytes each), as KIVI (arXiv 2402.02750) stores its scales and zero points:

- `bf16`: the reference; no quantization, no scale.
- `fp8` (e4m3): symmetric, one scale per group, s = max|x| / 448; x / s is cast to torch.float8_e4m3fn (round to
  nearest even). 1 byte per element plus 2 per group.
- `fp4` (e2m1, the OCP microscaling element type): symmetric, one scale per group, s = max|x| / 6; x / s rounds to
  the nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even mantissa. Half a byte per element plus 2 per
  group (NVFP4 stores a 1-byte e4m3 scale per 16 elements instead; the docs say how that changes the bytes).
- `int8`, `int4`, `int2`: asymmetric (min/max), one scale and one zero point per group: s = (max - min) /
  (2^bits - 1), q = clamp(round((x - min) / s), 0, 2^bits - 1), x' = q·s + min. bits/8 bytes per element plus 4 per
  group.

Groups run along the last axis of what `quantize` is given; `grouped` moves the axis a caller wants there
("token": a token's head vector, channel after channel; "channel": one channel over consecutive tokens, the way
KIVI quantizes keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from kvbench.errors import KvbenchError
from kvbench.models import ModelGeometry

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes; odd entries have mantissa bit 1
SCALE_BYTES = 2  # an fp16 scale or zero point
AXES = ("token", "channel")


@dataclass(frozen=True)
class KvFormat:
    name: str
    bits: int  # per element
    kind: str  # "none" (bf16), "float" (symmetric, scale only) or "int" (asymmetric, scale and zero point)

    @property
    def stored_per_group(self) -> int:
        """Bytes of metadata per group: a scale (float formats) or a scale and a zero point (integer formats)."""
        return {"none": 0, "float": SCALE_BYTES, "int": 2 * SCALE_BYTES}[self.kind]

    def bytes_per_element(self, group: int) -> Fraction:
        """Exact bytes per cached element, metadata included: bits/8 + stored_per_group/group."""
        return Fraction(self.bits, 8) + Fraction(self.stored_per_group, group)


FORMATS = {
    f.name: f
    for f in (
        KvFormat("bf16", 16, "none"),
        KvFormat("fp8", 8, "float"),
        KvFormat("int8", 8, "int"),
        KvFormat("fp4", 4, "float"),
        KvFormat("int4", 4, "int"),
        KvFormat("int2", 2, "int"),
    )
}


def kv_format(name: str, option: str = "--kv-dtypes") -> KvFormat:
    if name not in FORMATS:
        raise KvbenchError(f"{option}: unknown KV format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def check_group(group: int, head_dim: int, axis: str, option: str = "--group-size") -> None:
    """A group must be ≥ 1 element; along a token's head vector it must divide head_dim (no group straddles two
    heads). Along tokens any size works: the last group of a sequence may be short (see `grouped`)."""
    if group < 1:
        raise KvbenchError(f"{option} {group}: a group holds at least 1 element")
    if axis not in AXES:
        raise KvbenchError(f"grouping axis {axis!r}: choose {' or '.join(AXES)}")
    if axis == "token" and head_dim % group:
        raise KvbenchError(f"{option} {group} does not divide head_dim {head_dim}; give a divisor such as 32 or 64")


def bytes_per_token(model: ModelGeometry, fmt: KvFormat, group: int) -> Fraction:
    """KV bytes one token costs in `fmt`: layers × (K and V) × kv_heads × head_dim elements, each at
    `fmt.bytes_per_element(group)`. Llama-3-8B in int4 with groups of 32: 65,536 elements × (1/2 + 4/32) B =
    40,960 B (bf16: 131,072 B)."""
    elements = model.layers * (1 if model.mla else 2) * model.kv_heads * model.head_dim
    return elements * fmt.bytes_per_element(group)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """What an fp16 field stores of `x` (scales and zero points are kept in fp16)."""
    return x.to(torch.float16).to(x.dtype)


def _round_fp4(y: torch.Tensor) -> torch.Tensor:
    """y (|y| ≤ 6) to the nearest fp4 value, halfway to the even mantissa (round half to even, as the OCP MX spec
    rounds): 0.75 → 1, 1.25 → 1, 2.5 → 2, 3.5 → 4, 5 → 4. The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2
    in [4, 6], so rounding y / spacing to an integer (torch.round: half to even) lands on it."""
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return (a / step).round_().mul_(step).clamp_(max=FP4_GRID[-1]).mul_(y.sign())


def quantize(x: torch.Tensor, fmt: KvFormat | str, group: int) -> torch.Tensor:
    """x (fp32, last axis a multiple of `group`) stored in `fmt` and read back (dequantized), as fp32."""
    fmt = kv_format(fmt) if isinstance(fmt, str) else fmt
    x = x.float().contiguous()  # permuted views (channel groups) would make every op below stride
    if fmt.kind == "none":
        return x.to(torch.bfloat16).float()
    if x.shape[-1] % group:
        raise KvbenchError(f"quantize: last axis {x.shape[-1]} is not a multiple of the group size {group}")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    if fmt.kind == "float":
        top = FP8_MAX if fmt.bits == 8 else FP4_GRID[-1]
        scale = _fp16(g.abs().amax(dim=-1, keepdim=True) / top)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
        y = (g / scale).clamp(-top, top)  # the fp16 scale may round down: saturate, as hardware does
        stored = y.to(torch.float8_e4m3fn).float() if fmt.bits == 8 else _round_fp4(y)
        return (stored * scale).reshape(x.shape)
    levels = 2**fmt.bits - 1
    low = _fp16(g.amin(dim=-1, keepdim=True))
    scale = _fp16((g.amax(dim=-1, keepdim=True) - low) / levels)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - low) / scale).clamp(0, levels)
    return (q * scale + low).reshape(x.shape)


def grouped(x: torch.Tensor, fmt: KvFormat | str, group: int, axis: str) -> torch.Tensor:
    """`quantize` a `[tokens, heads, head_dim]` cache with groups along `axis`: "token" (consecutive channels of
    one token's head vector) or "channel" (one channel over consecutive tokens: positions 0..g-1 form a group,
    then g..2g-1, …; a short last group is padded with copies of its last token, which moves neither its min,
    its max nor its max|x|, so the padding changes no stored value)."""
    fmt = kv_format(fmt) if isinstance(fmt, str) else fmt
    if fmt.kind == "none" or axis == "token":
        return quantize(x, fmt, group)
    if axis != "channel":
        raise KvbenchError(f"grouping axis {axis!r}: choose {' or '.join(AXES)}")
    tokens = x.shape[0]
    pad = -tokens % group
    along = x.permute(1, 2, 0)  # [heads, head_dim, tokens]
    if pad:
        along = torch.cat([along, along[..., -1:].expand(*along.shape[:-1], pad)], dim=-1)
    return quantize(along, fmt, group)[..., :tokens].permute(2, 0, 1)


@dataclass(frozen=True)
class MixedPolicy:
    """Recent blocks in `recent`, older ones in `old`: a block is old once every one of its tokens is at least
    `old_after_tokens` positions behind the newest token. At context length L with blocks of T tokens, blocks
    0..n-1 are old where n = max(0, (L - old_after_tokens) // T); the newest (possibly partial) block never is."""

    recent: KvFormat
    old: KvFormat
    old_after_tokens: int
    block_tokens: int

    def __post_init__(self):
        if self.old_after_tokens < 0:
            raise KvbenchError(f"--kv-old-after-tokens {self.old_after_tokens}: give a number of tokens ≥ 0")

    @property
    def label(self) -> str:
        return f"{self.recent.name}→{self.old.name} after {self.old_after_tokens} tok"

    def old_tokens(self, length: int) -> int:
        """Tokens stored in `old` at context length `length`."""
        return max(0, (length - self.old_after_tokens) // self.block_tokens) * self.block_tokens

    def bytes_per_token(self, model: ModelGeometry, group: int, lengths) -> Fraction:
        """Mean bytes per token over sequences of the given final lengths: Σ bytes / Σ tokens, each sequence's
        bytes = old_tokens·B(old) + (L - old_tokens)·B(recent)."""
        b_old, b_recent = bytes_per_token(model, self.old, group), bytes_per_token(model, self.recent, group)
        total_tokens = total_bytes = 0
        for length in lengths:
            old = self.old_tokens(int(length))
            total_tokens += int(length)
            total_bytes += old * b_old + (int(length) - old) * b_recent
        if not total_tokens:
            raise KvbenchError("the mixed policy needs at least one sequence of ≥ 1 token to average over")
        return Fraction(total_bytes) / total_tokens

    def old_mask(self, lengths: torch.Tensor, tokens: int) -> torch.Tensor:
        """`[queries, tokens]` bool: position i is stored in `old` for a query whose context has lengths[q]
        tokens."""
        n_old = ((lengths - self.old_after_tokens).clamp(min=0) // self.block_tokens) * self.block_tokens
        return torch.arange(tokens, device=lengths.device).unsqueeze(0) < n_old.unsqueeze(1)
