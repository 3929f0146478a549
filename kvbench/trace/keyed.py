"""Keyed block ids: a recorded or imported prompt's blocks, hashed with a secret so that no text can be
recovered by guessing it (docs/semantics.md, Keyed block ids).

A generated trace's block ids come from content ids (`blockhash`); a real prompt's come from its token ids.
Block i's id is a keyed BLAKE2b of block i-1's id and block i's token ids, so equal ids mean the same tokens
from the start of the prompt to the end of that block (the prefix rule every backend relies on), and without
the key an id cannot be matched to a guessed prompt. The key comes from the environment (`KEY_ENV`) and is
never written to a trace, a log or a summary; traces hashed with one key share blocks only with each other.

`rekey` gives every id of a trace a new one under another key: a bijection in practice (64-bit ids), so
equal stays equal and different stays different, and a trace re-keyed for publication keeps its cache
behaviour exactly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from kvbench.errors import KvbenchError

KEY_ENV = "KVBENCH_HASH_KEY"
DIGEST = 8  # bytes: ids are uint64, as the schema's block_hashes are


def hash_key(env: str = KEY_ENV, environ=os.environ) -> bytes:
    """The hashing secret from the environment variable `env`, as a 64-byte BLAKE2b key (any text is
    accepted: it is hashed to the key's length). A missing or empty variable is an error saying what to set."""
    secret = environ.get(env, "")
    if not secret:
        raise KvbenchError(
            f"set {env} to a secret to hash prompts with (e.g. export {env}=$(openssl rand -hex 32)); it is never "
            "stored, and traces hashed with the same secret share blocks"
        )
    return hashlib.blake2b(secret.encode(), digest_size=64).digest()


def block_ids(tokens: Sequence[int] | np.ndarray, block_size: int, key: bytes) -> np.ndarray:
    """The prefix-chained keyed ids of a prompt's blocks (the last one partial when the length is not a
    multiple of `block_size`): ceil(len(tokens) / block_size) uint64 ids."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    arr = np.asarray(tokens, dtype=np.int64)
    data = arr.astype("<u4", copy=False).tobytes() if arr.size else b""  # token ids fit 32 bits
    n = -(-arr.size // block_size)
    out = np.empty(n, dtype=np.uint64)
    prev = b""
    step = 4 * block_size
    for i in range(n):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], key=key, digest_size=DIGEST).digest()
        out[i] = int.from_bytes(prev, "little")
    return out


def rekey(ids: np.ndarray, key: bytes) -> np.ndarray:
    """Every id replaced by its keyed hash under `key`: the same id always gets the same new one."""
    flat = np.asarray(ids, dtype=np.uint64)
    unique, inverse = np.unique(flat, return_inverse=True)
    new = np.fromiter(
        (int.from_bytes(hashlib.blake2b(int(u).to_bytes(8, "little"), key=key, digest_size=DIGEST).digest(), "little")
         for u in unique),
        dtype=np.uint64,
        count=unique.size,
    )  # fmt: skip
    return new[inverse].reshape(flat.shape)
