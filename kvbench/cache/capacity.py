"""Cache capacities as users say them (blocks, tokens or bytes), converted with a model's geometry
(kvbench/models)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvbench.errors import KvbenchError
from kvbench.models.geometry import KV_DTYPE_BYTES, MODELS

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
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)\s*([kmg]?)\s*([a-z]*)\s*$")
# Far beyond any real pool (10^12 blocks of 16 tokens at one byte a token is 16 TB of KV), and small enough
# that kernels' int64 arithmetic on capacities (slot counts, bytes per block times blocks) cannot overflow.
MAX_BLOCKS = 10**12
_EXAMPLES = "write a positive whole number of blocks (10000), tokens (5M tok) or a size with a unit (40GiB)"


@dataclass(frozen=True)
class Capacity:
    text: str  # as the user wrote it
    blocks: int

    def label(self) -> str:
        return str(self.blocks)


def _exact(number: str) -> Fraction:
    """The number as written, exactly: '1.5' is 3/2 and '1e30' an integer, no float rounding either way."""
    mantissa, _, exponent = number.partition("e")
    if len(exponent) > 4:  # '1e99999' would build a 100,000-digit integer; anything that long is out of range
        return Fraction(MAX_BLOCKS) * 2**64
    return Fraction(mantissa) * 10 ** int(exponent or 0)


def parse_capacity(
    text: str, block_size: int, model: str | None = None, kv_dtype: str = "bf16", option: str = "--capacity"
) -> Capacity:
    """'10000' -> blocks; '5M tok' / '5000000 tokens' -> tokens; '40GiB' / '512 MB' -> bytes via the model.

    A number of blocks must be whole ('1.5' is refused, '1.5k' is 1500); tokens and bytes round down to
    whole blocks of `block_size` tokens. Every refusal is a KvbenchError naming `option` and the value.
    """
    m = _PATTERN.match(str(text).lower().replace("_", ""))
    if not m:
        raise KvbenchError(f"{option} {text!r} is not understood; {_EXAMPLES}")
    number, scale, unit = _exact(m.group(1)), m.group(2), m.group(3)
    if scale and scale + unit in _UNITS:  # '40gib' splits as ('g', 'ib')
        unit, scale = scale + unit, ""
    if unit not in _UNITS:
        raise KvbenchError(f"{option} {text!r}: unknown unit {unit!r}; use blocks, tok, B, KB/MB/GB or KiB/MiB/GiB")
    kind, factor = _UNITS[unit]
    value = number * _SCALE[scale] * factor
    if kind == "blocks":
        if value.denominator != 1:
            raise KvbenchError(f"{option} {text!r} is not a whole number of blocks; {_EXAMPLES}")
        blocks = value
    elif kind == "tokens":
        blocks = value / block_size
    else:
        if model is None:
            raise KvbenchError(f"{option} {text!r} is in bytes: pass --model (one of {', '.join(MODELS)}) to convert")
        if model not in MODELS:
            raise KvbenchError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
        if kv_dtype not in KV_DTYPE_BYTES:
            raise KvbenchError(f"unknown KV dtype {kv_dtype!r}; choose one of: {', '.join(KV_DTYPE_BYTES)}")
        per_token = Fraction(MODELS[model].kv_bytes_per_token(kv_dtype))
        blocks = value / (per_token * block_size)
    blocks = int(blocks)  # Fraction → int rounds toward zero: whole blocks only
    if blocks <= 0:
        raise KvbenchError(f"{option} {text!r} is less than one block of {block_size} tokens; it must be > 0")
    if blocks > MAX_BLOCKS:
        raise KvbenchError(f"{option} {text!r} is more than the {MAX_BLOCKS:,} blocks kvbench handles")
    return Capacity(str(text).strip(), blocks)


def parse_size(text: str, option: str) -> int:
    """'16GiB' / '40 GB' / '512MiB' / '1000000' (bytes) -> whole bytes, rounded down; a KvbenchError naming `option`
    otherwise. The byte units of `parse_capacity`, for options that are a memory size only."""
    m = _PATTERN.match(str(text).lower().replace("_", ""))
    unit = (m.group(2) + m.group(3)) if m else None
    if not m or (unit and unit not in _UNITS) or (unit and _UNITS[unit][0] != "bytes"):
        raise KvbenchError(f"{option} {text!r} is not a size; write e.g. 16GiB, 40GB or 512MiB")
    size = int(_exact(m.group(1)) * (_UNITS[unit][1] if unit else 1))
    if size < 1:
        raise KvbenchError(f"{option} {text!r} is less than one byte")
    return size


def parse_capacities(
    spec: str, block_size: int, model: str | None = None, kv_dtype: str = "bf16", option: str = "--capacity"
) -> list[Capacity]:
    """A comma-separated list of capacities, each as `parse_capacity` reads it; an empty list (or an empty
    item, as in '1000,,3000') is an error, never a run with no points."""
    parts = [s.strip() for s in str(spec).split(",")]
    if not any(parts):
        raise KvbenchError(f"{option} {spec!r} gives no capacity; e.g. {option} 10000 or {option} 1000,3000,10000")
    if not all(parts):
        raise KvbenchError(f"{option} {spec!r} has an empty item between its commas")
    return [parse_capacity(p, block_size, model, kv_dtype, option) for p in parts]


def check_capacities(spec: str, model: str | None = None, kv_dtype: str = "bf16", option: str = "--capacity") -> None:
    """Refuse a malformed capacity list before anything runs, when the trace (and so its block size) is not
    known yet: the form, the unit, whole blocks, the range, and --model for sizes in bytes. Only 'less than one
    block' for tokens or bytes waits for the block size."""
    parse_capacities(spec, 1, model, kv_dtype, option)
