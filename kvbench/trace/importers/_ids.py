"""Block-id handling shared by the importers: keep, chain or invent ids so they are prefix-chained."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvbench.errors import TraceFormatError
from kvbench.trace.blockhash import chain_ids, content_ids, is_prefix_consistent, name_key, prompt_block_ids


def prefix_chained(hashes: pa.ListArray, label: str) -> tuple[pa.ListArray, bool]:
    """Keep source ids that already behave as prefix-chained ids (so exports round-trip), else chain them."""
    if is_prefix_consistent(hashes):
        return hashes.cast(pa.list_(pa.uint64())), False
    return chain_ids(hashes, namespace=name_key("import", label)), True


def unique_block_ids(namespace: np.uint64, row: np.ndarray, input_tokens: np.ndarray, block_size: int) -> pa.ListArray:
    """Block ids that no other request shares: one content id per request (by its source row), chained."""
    n = input_tokens.size
    _, ids = prompt_block_ids(np.arange(n), content_ids(namespace, row), input_tokens, n, block_size)
    return ids


def check_block_counts(src, lines: list[int], input_tokens: np.ndarray, hashes: list[list], block_size: int) -> None:
    """Every record needs ceil(input / block_size) ids; the error names the line and a block size that fits."""
    counts = BlockCounts(src, block_size)
    counts.add(lines, input_tokens, hashes)
    counts.check()


_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


class BlockCounts:
    """`check_block_counts` over a source read batch by batch: the first bad line, how many differ, and the
    block sizes that fit every record so far (the hint)."""

    def __init__(self, src, block_size: int):
        self.src, self.block_size = src, block_size
        self.first: tuple[int, int, int] | None = None  # line, ids, input_length of the first bad record
        self.bad = 0
        self.fitting = set(_SIZES)

    def add(self, lines: list[int], input_tokens: np.ndarray, hashes: list[list]) -> None:
        n_blocks = np.fromiter((len(h) for h in hashes), dtype=np.int64, count=len(hashes))
        bad = np.flatnonzero(n_blocks != -(-input_tokens // self.block_size))
        if bad.size and self.first is None:
            row = int(bad[0])
            self.first = (lines[row], int(n_blocks[row]), int(input_tokens[row]))
        self.bad += int(bad.size)
        self.fitting = {bs for bs in self.fitting if np.array_equal(-(-input_tokens // bs), n_blocks)}

    def check(self) -> None:
        if self.first is None:
            return
        line, ids, inp = self.first
        bs = self.block_size
        hint = f"; the hash_ids fit --block-size {min(self.fitting)}" if self.fitting else ""
        raise TraceFormatError(
            f"{self.src}: line {line}: field 'hash_ids' has {ids} ids but input_length {inp} needs "
            f"ceil({inp}/{bs}) = {-(-inp // bs)} ({self.bad} rows differ){hint}"
        )


class PrefixConsistency:
    """`blockhash.is_prefix_consistent` over a source read batch by batch. Keeps, per distinct id seen, the id
    before it and its position (24 bytes an id: it grows with the distinct blocks, not the records), as sorted
    runs merged like a binary counter, so each batch costs a few binary searches per id."""

    def __init__(self):
        self.ok = True
        self._runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ids sorted, previous id, position)

    def add(self, raw: pa.ListArray) -> None:
        if not self.ok:
            return
        offsets = np.asarray(raw.offsets)
        values = np.asarray(raw.values.cast(pa.uint64()))[offsets[0] : offsets[-1]]
        if values.size == 0:
            return
        lengths = np.diff(offsets)
        pos = np.arange(values.size) - np.repeat(offsets[:-1] - offsets[0], lengths)
        prev = np.empty_like(values)
        prev[1:] = values[:-1]
        prev[pos == 0] = np.uint64(0xFFFFFFFFFFFFFFFF)
        order = np.argsort(values, kind="stable")
        v, p, q = values[order], prev[order], pos[order]
        same = v[1:] == v[:-1]
        if np.any(same & ((p[1:] != p[:-1]) | (q[1:] != q[:-1]))):
            self._fail()
            return
        first = np.concatenate([[True], ~same])
        v, p, q = v[first], p[first], q[first]
        for ids, prevs, poss in self._runs:
            at = np.minimum(np.searchsorted(ids, v), ids.size - 1)
            seen = ids[at] == v
            if np.any(seen & ((prevs[at] != p) | (poss[at] != q))):
                self._fail()
                return
            v, p, q = v[~seen], p[~seen], q[~seen]  # (an id is in one run only)
        self._runs.append((v, p, q))
        while len(self._runs) > 1 and self._runs[-2][0].size <= 2 * self._runs[-1][0].size:
            (a, pa_, qa), (b, pb, qb) = self._runs[-2], self._runs[-1]
            merged = np.argsort(np.concatenate([a, b]), kind="stable")
            self._runs[-2:] = [tuple(np.concatenate(x)[merged] for x in ((a, b), (pa_, pb), (qa, qb)))]

    def _fail(self) -> None:
        self.ok, self._runs = False, []
