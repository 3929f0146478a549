"""engine-sim refuses a malformed size (--hbm-capacity, --dram-capacity, --ssd-capacity, --global-pool) when it is
built, before any replay, naming the option; a good one means the same number of blocks whichever unit it is written
in."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from kvbench.backends.enginesim import EngineSimBackend

from kvbench.errors import KvbenchError
from kvbench.run.runner import run_replay
from kvbench.trace.files import read_meta


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("hbm_capacity", "1.5", "--hbm-capacity '1.5' is not a whole number of blocks"),
        ("hbm_capacity", "99999999999999999999", "--hbm-capacity '99999999999999999999' is more than"),
        ("dram_capacity", "lots", "--dram-capacity 'lots' is not understood"),
        ("ssd_capacity", "-1GB", "--ssd-capacity '-1GB' is not understood"),
        ("global_pool", "1e999", "--global-pool '1e999' is more than"),
    ],
)
def test_bad_sizes_are_refused_at_construction(option, value, message):
    with pytest.raises(KvbenchError) as err:
        EngineSimBackend(**{option: value})
    assert message in str(err.value)


def test_a_size_is_the_same_cache_in_every_unit_and_an_empty_pool_is_none(sample_head, tmp_path):
    """--hbm-capacity 300 (blocks), 300 blocks' tokens and 300 blocks' bytes of llama3-8b's bf16 KV (32 layers ×
    8 KV heads × 128 dims × K and V × 2 bytes a token, from the model card) are one cache: the same hits and
    evictions request by request, which a different size does not give; an empty --global-pool is no pool."""
    trace = sample_head("chat", 300)
    bs = read_meta(trace).block_size
    kv_bytes_per_token = 32 * 8 * 128 * 2 * 2

    def run(name, **options):
        run_dir, _ = run_replay(
            trace, "engine-sim", {"model": "llama3-8b", **options}, out=tmp_path / name, report=False
        )
        rows = pq.read_table(run_dir / "requests.parquet")
        return rows.column("hit_tokens").to_pylist(), rows.column("evictions").to_pylist()

    blocks = run("blocks", hbm_capacity="300")
    assert sum(blocks[1]) > 0  # small enough to evict
    assert run("tokens", hbm_capacity=f"{300 * bs} tok") == blocks
    assert run("bytes", hbm_capacity=f"{300 * bs * kv_bytes_per_token}B") == blocks
    assert run("bytes-short-of-301", hbm_capacity=f"{301 * bs * kv_bytes_per_token - 1}B") == blocks  # whole blocks
    assert run("no-pool", hbm_capacity="300", global_pool="") == blocks
    assert run("other", hbm_capacity="200") != blocks
