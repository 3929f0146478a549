"""The one-pass curve (kvbench/cache/curve.py) is exact: at every capacity it gives the hit blocks a replay of the
policy's kernel gives, and it reproduces the reference numbers of docs/semantics.md (Reference figures)."""

import json

import numpy as np
import pytest

from kvbench.cache import policies
from kvbench.cache.curve import lru_curve
from kvbench.cache.densify import densify
from kvbench.cache.prepared import PreparedTrace, prepare
from kvbench.trace.files import read_trace
from tests.conftest import REPO, SHARED

MOONCAKE = REPO / "traces/mooncake/conversation_trace.parquet"
SAMPLES = sorted((REPO / "traces/samples").glob("*.parquet"))
REFERENCE = SHARED / "reference/mooncake_conversation.json"
# docs/semantics.md, Reference figures: classic block LRU on the Mooncake conversation trace (512-token blocks)
LRU_REFERENCE = {
    "token_all": {32: 0.0329, 128: 0.0418, 512: 0.0430, 2048: 0.0560, 8192: 0.1847, 32768: 0.3415},
    "token_steady": {32: 0.0359, 128: 0.0446, 512: 0.0454, 2048: 0.0564, 8192: 0.1874, 32768: 0.3558},
    "block_all": {32: 0.0322, 128: 0.0410, 512: 0.0422, 2048: 0.0549, 8192: 0.1812, 32768: 0.3349},
}


def _load(path):
    table, meta = read_trace(path)
    return prepare(table, meta.block_size)


@pytest.fixture(scope="module")
def mooncake():
    return _load(MOONCAKE)


@pytest.fixture(scope="module")
def mooncake_curve(mooncake):
    return lru_curve(mooncake)


def _capacities(trace):
    caps = {1, 2, 3, 5, 8, 32, 100, 512, 1000, 3000, 5859, 10000, 19531, 30000, 100000}
    return sorted(c for c in caps | {trace.n_keys - 1, trace.n_keys, trace.n_keys + 7} if c > 0)


def _check_against_kernel(trace, curve, policy):
    start = int(trace.n_requests * curve.warmup)
    for cap in _capacities(trace):
        replay = policy.kernel(trace, cap).hit_blocks
        np.testing.assert_array_equal(curve.hit_blocks(cap), replay, err_msg=f"{policy.name} at {cap} blocks")
        pts = curve.at([cap])
        tokens = np.minimum(replay.astype(np.int64) * trace.block_size, trace.input_tokens)
        assert pts.hit_blocks_all[0] == replay.sum() and pts.hit_blocks_steady[0] == replay[start:].sum()
        assert pts.hit_tokens_all[0] == tokens.sum() and pts.hit_tokens_steady[0] == tokens[start:].sum()


def test_curve_equals_lru_replays_on_mooncake(mooncake, mooncake_curve):
    _check_against_kernel(mooncake, mooncake_curve, policies.get("lru"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_curve_equals_lru_replays_on_samples(path):
    trace = _load(path)
    _check_against_kernel(trace, lru_curve(trace), policies.get("lru"))


def test_reproduces_the_lru_reference_numbers(mooncake_curve):
    caps = sorted(LRU_REFERENCE["token_all"])
    rates = mooncake_curve.hit_rates(caps)
    for key, expected in LRU_REFERENCE.items():
        assert rates[key] == pytest.approx([expected[c] for c in caps], abs=0.0005), key


def test_reproduces_the_shared_reference_file(mooncake_curve):
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not present")
    ref = json.loads(REFERENCE.read_text())["lru"]
    for key, points in ref.items():
        caps = [int(c) for c in points]
        assert mooncake_curve.hit_rates(caps)[key] == pytest.approx(list(points.values()), abs=0.0005), key
    inf = json.loads(REFERENCE.read_text())["infinite"]
    huge = mooncake_curve.hit_rates([10**9])
    assert huge["token_all"][0] == pytest.approx(inf["token_all"], abs=0.0005)
    assert huge["token_steady"][0] == pytest.approx(inf["token_steady"], abs=0.0005)
    assert huge["block_all"][0] == pytest.approx(inf["block_all"], abs=0.0005)


def test_monotone_in_capacity(mooncake, mooncake_curve):
    caps = np.arange(0, mooncake.n_keys + 3)
    pts = mooncake_curve.at(caps)
    for series in (pts.hit_tokens_all, pts.hit_tokens_steady, pts.hit_blocks_all, pts.hit_blocks_steady):
        assert (np.diff(series) >= 0).all()
    assert pts.hit_blocks_all[0] == 0 and pts.hit_tokens_all[0] == 0
    previous = np.zeros(mooncake.n_requests, np.int32)
    for cap in (1, 10, 100, 1000, 10000, 100000, mooncake.n_keys):
        hits = mooncake_curve.hit_blocks(cap)
        assert (hits >= previous).all() and (hits <= mooncake.max_hit).all()
        previous = hits


def test_summary_is_json_ready(mooncake_curve):
    s = mooncake_curve.summary(np.array([100, 10000]))
    assert json.loads(json.dumps(s)) == s
    assert s["capacity_blocks"] == [100, 10000]
    assert set(s) == {"capacity_blocks", "token_all", "token_steady", "block_all", "block_steady"}
    with pytest.raises(ValueError):
        mooncake_curve.at([-1])


def _random_trace(seed: int, block_size: int = 4) -> PreparedTrace:
    """Conversations that extend earlier prompts, shared prefixes, repeated blocks inside a prompt, partial and
    full last blocks: the cases where a curve could disagree with a replay."""
    rng = np.random.default_rng(seed)
    prompts, ids, offsets, tokens = [], [], [0], []
    fresh = iter(range(10**6))
    for _ in range(int(rng.integers(5, 40))):
        if prompts and rng.random() < 0.7:
            base = prompts[int(rng.integers(len(prompts)))]
            prompt = base[: int(rng.integers(0, len(base) + 1))]
        else:
            prompt = []
        prompt = prompt + [next(fresh) for _ in range(int(rng.integers(0, 6)))]
        if prompt and rng.random() < 0.15:
            prompt.append(prompt[int(rng.integers(len(prompt)))])  # a block repeated in the same prompt
        if not prompt:
            prompt = [next(fresh)]
        prompts.append(prompt)
        ids += prompt
        offsets.append(len(ids))
        tokens.append(len(prompt) * block_size - int(rng.integers(0, block_size)))
    offsets = np.array(offsets, np.int64)
    keys, parent = densify(np.array(ids, np.uint64), offsets)
    n = len(tokens)
    return PreparedTrace(
        block_size,
        offsets,
        keys,
        parent,
        np.array(tokens, np.int64),
        np.diff(offsets).astype(np.int32),
        np.zeros(n, np.int32),
        ["(none)"],
        np.full(n, 35, np.int8),
    )


@pytest.mark.parametrize("seed", range(40))
def test_small_random_traces_against_the_references(seed):
    trace = _random_trace(seed)
    curve = lru_curve(trace)
    for cap in range(1, trace.n_keys + 2):
        np.testing.assert_array_equal(curve.hit_blocks(cap), policies.get("lru").reference(trace, cap).hit_blocks)
