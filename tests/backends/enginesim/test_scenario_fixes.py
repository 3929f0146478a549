"""Four engine-sim scenarios checked against arithmetic done by hand on traces of a few requests (issue 13,
item 5): shared-base LoRA deltas charged to the pool, position-independent media KV evicted like any block,
a user's deletion that lets recomputed KV be cached again, and attention/FFN transfers in every step.

The traces use 16-token blocks and requests far enough apart (10 s) that each one runs alone. Unless a test says
otherwise the policy is `lru`: it caches every block of a request in order and evicts the least recently used
one, which keeps the counting simple. llama3-8b in bf16 holds 32 layers × 8 KV heads × 128 × 2 (K and V) × 2
bytes = 131,072 bytes of KV per token, 2 MiB per block."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvbench.run.rundir import fresh_dir
from kvbench.run.runner import run_replay
from kvbench.trace.files import new_meta, write_trace

BS = 16
KV_BLOCK = 32 * 8 * 128 * 2 * 2 * BS  # bytes of one block of llama3-8b KV


def chain(*contents) -> list[int]:
    """Prefix-chained block ids: block i's id depends on the contents of blocks 0..i (as a prompt's keys do)."""
    return [_digest(contents[: i + 1]) for i in range(len(contents))]


def _digest(x) -> int:
    """A stable 63-bit id (Python's hash() of a string changes from run to run)."""
    return int.from_bytes(hashlib.blake2b(repr(x).encode(), digest_size=8).digest(), "little") >> 1


def request(i, at, contents, tokens=None, out=1, **cols) -> dict:
    return {
        "request_id": f"r{i}",
        "arrival_s": float(at),
        "input_tokens": tokens or BS * len(contents),
        "output_tokens": out,
        "block_hashes": chain(*contents),
        **cols,
    }


def replay(tmp_path, rows, name, **opts):
    path = tmp_path / f"{name}.parquet"
    if not path.exists():
        write_trace(pa.Table.from_pylist(rows), path, new_meta(BS, {"test": name}))
    out = fresh_dir(tmp_path / f"run-{name}")  # a new folder for every replay: runs are never replaced
    run_dir, summary = run_replay(path, "engine-sim", opts, out=out, report=False)
    return pq.read_table(run_dir / "requests.parquet").to_pydict(), summary["points"][0]


def facts(point, name):
    return point["engine"]["scenarios"][name]


# --- 1. shared-base LoRA: deltas take pool blocks --------------------------------------------------------------


def lora_rounds(adapters: int) -> list[dict]:
    """Two rounds of one request per adapter: a shared 20-block prefix P, then a 1-block suffix of its own."""
    prefix = tuple(("P", b) for b in range(20))
    rows = []
    for _round in range(2):
        for a in range(adapters):
            i = len(rows)
            rows.append(request(i, 10 * i, prefix + (("own", i),), lora=f"adapter-{a}"))
    return rows


def test_shared_base_charges_delta_pages_and_saves_kv_on_a_shared_prefix(tmp_path):
    rows, n = lora_rounds(10), 10
    _, iso = replay(tmp_path, rows, "lora", policy="lru", hbm_capacity="1000", lora_kv="isolated")
    _, shared = replay(tmp_path, rows, "lora", policy="lru", hbm_capacity="1000", lora_kv="shared-base")
    a, b = facts(iso, "multi-lora"), facts(shared, "multi-lora")
    # isolated: every adapter its own P (20) + two suffixes; its second request hits its own P
    assert (a["cached_blocks"], a["delta_blocks"], a["hit_blocks"]) == (22 * n, 0, 20 * n)
    # shared-base, 10 deltas per page: P once + 2n suffixes; pages per adapter: round 1 covers blocks 0-9,
    # 10-19 and the suffix (3), round 2 touches the first two and adds one for its new suffix (1)
    assert b["deltas_per_block"] == 10
    assert (b["cached_blocks"], b["delta_blocks"]) == (20 + 2 * n, 4 * n)
    # a hit needs the adapter's own pages: round 1 hits nothing (no pages yet), round 2 hits P
    assert b["hit_blocks"] == 20 * n
    assert b["kv_bytes_occupied"] == (20 + 6 * n) * KV_BLOCK < a["kv_bytes_occupied"] == 22 * n * KV_BLOCK


def test_delta_pages_never_take_the_kv_above_the_pool_and_keep_more_hits_in_a_small_one(tmp_path):
    rows, n, pool = lora_rounds(10), 10, 100
    _, iso = replay(tmp_path, rows, "lora", policy="lru", hbm_capacity=str(pool), lora_kv="isolated")
    _, shared = replay(tmp_path, rows, "lora", policy="lru", hbm_capacity=str(pool), lora_kv="shared-base")
    a, b = facts(iso, "multi-lora"), facts(shared, "multi-lora")
    assert a["pool_bytes"] == b["pool_bytes"] == pool * KV_BLOCK
    # isolated needs 21 blocks per adapter: round 1 (210) overflows 100, and LRU evicts each adapter's P before
    # its second request; shared-base needs 20 + 2n + 4n = 80 blocks, so nothing is evicted and round 2 hits P
    assert a["hit_blocks"] == 0 and a["kv_bytes_occupied"] == pool * KV_BLOCK
    assert b["hit_blocks"] == 20 * n and b["kv_bytes_occupied"] == 80 * KV_BLOCK
    # a pool smaller than shared-base's 80: pages evict like blocks and the total stays inside the pool
    for policy in ("lru", "vllm"):
        _, tight = replay(tmp_path, rows, "lora", policy=policy, hbm_capacity="50", lora_kv="shared-base")
        f = facts(tight, "multi-lora")
        assert f["delta_blocks"] > 0 and f["kv_bytes_occupied"] <= f["pool_bytes"] == 50 * KV_BLOCK


# --- 2. position-independent media KV obeys the pool ----------------------------------------------------------


def media_rows() -> list[dict]:
    """r0 and r2 carry the same 64-token image (blocks 1-4) after different first blocks; r1 between them is
    unrelated text. Prompts are 97 tokens: 6 full blocks and a partial one, 7 blocks in all."""
    image = [{"hash": 77, "modality": "image", "offset": BS, "tokens": 4 * BS}]
    body = tuple(("img", b) for b in range(4)) + (("tail", 0), ("tail", 1))
    return [
        request(0, 0, (("text", "A"),) + body, tokens=97, mm_items=image),
        request(1, 10, tuple(("other", b) for b in range(7)), tokens=97, mm_items=[]),
        request(2, 20, (("text", "B"),) + body, tokens=97, mm_items=image),
    ]


def test_media_hit_rate_falls_when_the_pool_evicts_the_items_kv(tmp_path):
    rows = media_rows()
    image = lambda p: facts(p, "mm-cache")["hit_rate_by_modality"]["image"]  # noqa: E731
    big_rows, big = replay(tmp_path, rows, "mm", policy="lru", hbm_capacity="100", mm_cache="position-independent")
    _, small = replay(tmp_path, rows, "mm", policy="lru", hbm_capacity="8", mm_cache="position-independent")
    _, prefix = replay(tmp_path, rows, "mm", policy="lru", hbm_capacity="100", mm_cache="prefix")
    # 100 blocks keep all 21: r2 reuses r0's 4 image blocks although its first block differs (4 of 8 blocks)
    assert image(big) == 4 / 8 and big_rows["hit_tokens"] == [0, 0, 4 * BS]
    # 8 blocks: r1's 7 blocks evict 6 of r0's, oldest first (blocks 0-5, the whole image): nothing to reuse
    assert image(small) == 0.0
    assert image(prefix) == 0.0  # r2's prefix differs from r0's at block 0


# --- 3. deleting a user's KV removes what exists then, and only that -------------------------------------------


def user_rows() -> list[dict]:
    mine = tuple(("u-doc", b) for b in range(4))
    theirs = tuple(("v-doc", b) for b in range(4))
    return [
        request(0, 0, mine, user_id="u"),
        request(1, 5, theirs, user_id="v"),
        request(2, 10, mine, user_id="u"),  # hits u's 4 blocks
        # --delete-user u@20
        request(3, 30, mine, user_id="u"),  # recomputes them: cached again
        request(4, 35, theirs, user_id="v"),  # v's KV untouched
        request(5, 40, mine, user_id="u"),  # hits the recomputed KV
    ]


def test_a_deletion_removes_the_users_kv_and_what_is_computed_after_it_is_cached_again(tmp_path):
    rows, point = replay(tmp_path, user_rows(), "user", policy="lru", hbm_capacity="100", delete_user=("u@20",))
    f = facts(point, "user-kv")
    assert rows["hit_tokens"] == [0, 0, 4 * BS, 0, 4 * BS, 4 * BS]
    assert f["deletions"] == [{"user": "u", "at_s": 20.0, "blocks": 4}]
    assert f["hits_on_deleted_kv"] == 0 and f["hits_before_deletion"] == {"u": 4}
    # u's GB-hours: 4 blocks from 0 s to the deletion at 20 s, then the recomputed 4 from 30 s (r3's start) to
    # the end of the run (r5's finish); none accrue between 20 s and 30 s
    end = rows["e2el_s"][5] + 40.0
    want = 4 * KV_BLOCK * (20.0 + end - 30.0) / 1e9 / 3600
    assert f["gb_hours_by_user"]["u"] == pytest.approx(want, rel=1e-9)
    assert f["gb_hours_by_user"]["v"] == pytest.approx(4 * KV_BLOCK * (end - 5.0) / 1e9 / 3600, rel=1e-9)  # from 5 s


# --- 4. attention / FFN disaggregation costs every step --------------------------------------------------------

LAYERS, HIDDEN, LINK = 32, 4096, 50e9  # llama3-8b, the default --kv-link-gbps
HOP = 5e-6


def test_attn_ffn_adds_its_transfer_to_every_step(tmp_path):
    rows = [request(0, 0, tuple(("q", b) for b in range(63)), tokens=1000, out=5)]
    agg, _ = replay(tmp_path, rows, "af", policy="lru")
    af, p = replay(tmp_path, rows, "af", policy="lru", disagg="attn-ffn")
    # per step: 2 crossings × 32 layers of hop latency, and each token's hidden state (bf16) there and back
    per_token = 2 * LAYERS * HIDDEN * 2 / LINK
    prefill = 2 * LAYERS * HOP + 1000 * per_token  # one step of 1000 tokens
    decode = 2 * LAYERS * HOP + 1 * per_token  # each of the 4 steps after it, one token
    assert af["ttft_s"][0] == pytest.approx(agg["ttft_s"][0] + prefill, rel=1e-9)
    assert af["tpot_s"][0] == pytest.approx(agg["tpot_s"][0] + decode, rel=1e-9)
    assert af["e2el_s"][0] == pytest.approx(agg["e2el_s"][0] + prefill + 4 * decode, rel=1e-9)
    f = facts(p, "disagg")
    assert f["added_latency_per_token_s"] == pytest.approx(decode)
    assert f["activation_bytes"] == (1000 + 4) * 2 * LAYERS * HIDDEN * 2


def test_pipeline_formula_by_hand():
    from kvbench.backends.enginesim.scenarios.disagg import pipeline_s

    # a=2, f=1, c=0.5 per layer and micro-batch, 3 layers: one round trip r = 4, bottleneck b = 2
    assert pipeline_s(2, 1, 0.5, 3, 1) == 12  # one micro-batch: 3 round trips one after another
    assert pipeline_s(2, 1, 0.5, 3, 4) == 4 * 3 * 2 + (4 - 2)  # m·b = 8 ≥ r: the bottleneck is never idle
    # a slow link, c = 4: r = 2 + 1 + 2·4 = 11, b = 4, m·b = 8 < r: latency-bound, the 2nd micro-batch b behind
    assert pipeline_s(2, 1, 4.0, 3, 2) == 3 * 11 + 1 * 4


def test_pipelined_attn_ffn_overlaps_a_prefill_and_equals_serial_for_one_decode(tmp_path):
    from kvbench.backends.enginesim import EngineSimBackend

    rows = [request(0, 0, tuple(("q", b) for b in range(63)), tokens=1000, out=5)]
    # a100: a roofline preset, whose step splits into weights and attention as the scenario takes it to
    hw = {"hardware": "a100"}
    agg, _ = replay(tmp_path, rows, "af", policy="lru", **hw)
    serial, _ = replay(tmp_path, rows, "af", policy="lru", disagg="attn-ffn", **hw)
    piped, p = replay(tmp_path, rows, "af", policy="lru", disagg="attn-ffn-pipelined", attn_ffn_micro_batches=2, **hw)
    assert facts(p, "disagg")["micro_batches"] == 2
    # a single decoding sequence is one micro-batch: the pipeline is the serial ring, L round trips
    assert piped["tpot_s"][0] == pytest.approx(serial["tpot_s"][0], rel=1e-9)
    # the 1000-token prefill splits in two micro-batches of 500 whose attention and FFN overlap
    backend = EngineSimBackend(policy="lru", disagg="attn-ffn-pipelined", attn_ffn_micro_batches=2, **hw)
    (scenario,) = backend.scenarios
    t = backend.latency.prefill_s(1000, 0)
    scenario.latency, scenario.act_bytes_per_token = backend.latency, 2 * LAYERS * HIDDEN * 2
    from kvbench.backends.enginesim.scenarios.disagg import attention_share, pipeline_s

    scenario.attn_share = s = attention_share(backend.model)
    assert s == pytest.approx(LAYERS * HIDDEN * (2 * 32 * 128 + 2 * 8 * 128) / 8_030_261_248)
    w_all, w_half = backend.latency.decode_step_s(1000, 0), backend.latency.decode_step_s(500, 0)
    a = (t - w_all) / (LAYERS * 2) + s * w_half / LAYERS
    f = (1 - s) * w_half / LAYERS
    c = HOP + 500 * HIDDEN * 2 / LINK
    want = pipeline_s(a, f, c, LAYERS, 2)
    assert scenario.pipelined_step_s(t, 1000) == pytest.approx(want, rel=1e-12)
    assert piped["ttft_s"][0] == pytest.approx(agg["ttft_s"][0] - t + want, rel=1e-9)
    assert want < t < t + 2 * LAYERS * HOP + 1000 * 2 * LAYERS * HIDDEN * 2 / LINK  # faster than both here
