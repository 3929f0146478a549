"""`example`: a FIFO cache of --capacity blocks, in plain Python — a kvbench backend plug-in as a third party
writes one (kvbench.run.backend.OfflineBackend). A request hits the cached prefix of its blocks (the leading
blocks that are cached); then each of its blocks not cached is inserted, the oldest inserted block evicted
when the cache is full. That is the rule of the built-in `--backend sim --policy fifo`, so both give the same
hits (on a trace without cache_salt or LoRA, which sim would fold into the keys)."""

from collections import OrderedDict

import click
import numpy as np

from kvbench.run.backend import PointResult


class ExampleBackend:
    name = "example"
    kind = "offline"  # the protocol it implements: kvbench.run.backend.OfflineBackend

    @classmethod
    def cli_options(cls):
        return [click.Option(["--capacity"], type=click.IntRange(min=1), required=True, help="cache size in blocks")]

    def __init__(self, capacity):
        self.capacity = capacity

    def config(self):
        return {"capacity": self.capacity}

    def replay(self, trace, meta, progress=None):
        cache = OrderedDict()  # block hash -> None, oldest insertion first
        hashes = trace.column("block_hashes").to_pylist()
        hit_blocks = np.zeros(len(hashes), np.int64)
        evictions = np.zeros(len(hashes), np.int64)
        for row, blocks in enumerate(hashes):
            while hit_blocks[row] < len(blocks) and blocks[hit_blocks[row]] in cache:
                hit_blocks[row] += 1
            for block in blocks:
                if block not in cache:
                    if len(cache) >= self.capacity:
                        cache.popitem(last=False)
                        evictions[row] += 1
                    cache[block] = None
        hit_tokens = np.minimum(hit_blocks * meta.block_size, trace.column("input_tokens").to_numpy())
        columns = {"hit_blocks": hit_blocks, "hit_tokens": hit_tokens, "evictions": evictions}
        yield PointResult({"policy": "fifo", "capacity_blocks": self.capacity}, columns)
