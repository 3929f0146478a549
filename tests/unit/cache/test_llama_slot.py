"""llama-slot: llama-server's slot choice, token prefix reuse and host prompt cache, on hand-made traces
(the live check against a real server is tests/integration/test_live_llamacpp.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvbench.cache import policies
from kvbench.cache.policies.llama_slot import LlamaSlots, lcp
from kvbench.cache.policies.llama_slot_tokens import with_tokens
from kvbench.cache.policy_options import parse_policy_options
from kvbench.cache.prepared import prepare
from kvbench.errors import KvbenchError
from kvbench.trace.schema import conform
from kvbench.trace.tokens import prompt_tokens
from tests.conftest import CHAT

BS = 4


def table(prompts, outputs=None, block_size=BS):
    """A trace from (block ids, input_tokens) pairs; a bare list of ids is whole blocks."""
    prompts = [p if isinstance(p, tuple) else (p, len(p) * block_size) for p in prompts]
    n = len(prompts)
    return conform(
        pa.table(
            {
                "request_id": [f"r{i}" for i in range(n)],
                "arrival_s": [float(i) for i in range(n)],
                "input_tokens": [t for _, t in prompts],
                "output_tokens": outputs or [1] * n,
                "block_hashes": pa.array([list(ids) for ids, _ in prompts], pa.list_(pa.uint64())),
            }
        )
    )


def run(prompts, capacity=10**6, outputs=None, **options):
    """Cached tokens per request, in token mode (the prompts `--backend openai` would send)."""
    t = table(prompts, outputs)
    opts = parse_policy_options({"vocab": 4096, **options}, ["llama-slot"])
    trace = with_tokens(t, BS, opts, prepare(t, BS))
    return policies.get("llama-slot").kernel(trace, capacity, opts).hit_tokens.tolist()


def test_a_repeated_prompt_recomputes_its_last_token():
    assert run([[1, 2, 3], [1, 2, 3]]) == [0, 11]


def test_reuse_is_token_by_token_not_in_blocks():
    # 10 tokens, then the same 10 and more: the partial third block is reused as far as its 2 tokens go
    assert run([([1, 2, 3], 10), ([1, 2, 3, 4], 16)]) == [0, 10]
    # parting inside a block keeps the tokens that happen to be equal there (here none but the shared blocks)
    got = run([[1, 2, 3], [1, 2, 9]])
    a, b = prompt_tokens(np.array([3], np.uint64), BS, BS, 4096), prompt_tokens(np.array([9], np.uint64), BS, BS, 4096)
    assert got == [0, 8 + lcp(a, b)]


def test_generated_tokens_stay_in_the_slot_but_match_no_prompt():
    # the slot holds 8 prompt + 2 generated tokens: the next prompt shares only the prompt part
    assert run([[1, 2], [1, 2, 3, 4]], outputs=[3, 1], slots=1) == [0, 8]


def test_slot_choice_by_similarity_else_least_recently_used():
    # two explicit slots: r0 goes to slot 1 (ties go to the last), r1 to slot 0 (the other never-used one);
    # r2 continues r0 and finds it by similarity even though slot 1 is the least recently used
    assert run([[1, 2, 3], [7, 8, 9], [1, 2, 3, 4]], slots=2, cache_ram_tokens=0) == [0, 0, 12]
    # with one slot and no prompt cache, r1 overwrote r0: nothing of it is left for r2
    assert run([[1, 2, 3], [7, 8, 9], [1, 2, 3, 4]], slots=1, cache_ram_tokens=0) == [0, 0, 0]


def test_the_prompt_cache_brings_back_a_slot_that_was_given_up():
    assert run([[1, 2, 3], [7, 8, 9], [1, 2, 3, 4]], slots=1) == [0, 0, 12]
    # the similarity threshold: a slot sharing too little of the prompt is not chosen by similarity
    assert run([[1, 2, 3], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]], slots=2, cache_ram_tokens=0) == [0, 0]
    assert run(
        [[1, 2, 3], [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]], slots=2, cache_ram_tokens=0, slot_similarity=0.05
    ) == [0, 4]


def test_cache_reuse_shifts_matching_chunks_after_the_prefix():
    # r1 drops block 2 of r0: without --cache-reuse only block 1 is reused, with it blocks 3-4 are shifted in
    prompts = [[1, 2, 3, 4], [1, 3, 4]]
    assert run(prompts, slots=1, cache_ram_tokens=0) == [0, 4]
    assert run(prompts, slots=1, cache_ram_tokens=0, cache_reuse=4) == [0, 11]


def test_the_context_is_split_over_explicit_slots():
    # 1024 tokens of context: one slot of 1024, or four of 256; a 300-token prompt does not fit in 256
    long = ([1, *range(100, 175)], 300)
    assert run([long, long], capacity=1024 // BS, slots=1)[1] == 299
    assert run([long, long], capacity=1024 // BS, slots=4) == [0, 0]


def test_block_keys_stand_for_tokens_without_vocab():
    t = table([([1, 2, 3], 10), ([1, 2, 3, 4], 16), ([1, 2, 3, 4], 16)])
    out = policies.get("llama-slot").kernel(prepare(t, BS), 10**6, {"slots": 1})
    assert out.hit_tokens is None and out.hit_blocks.tolist() == [0, 2, 3]  # 10 and 15 tokens, whole blocks


def test_bad_options_name_the_option():
    with pytest.raises(KvbenchError, match="--slots"):
        parse_policy_options({"slots": "0"}, ["llama-slot"])
    with pytest.raises(KvbenchError, match="--slot-similarity"):
        parse_policy_options({"slot_similarity": "2"}, ["llama-slot"])
    with pytest.raises(KvbenchError, match="--vocab"):
        parse_policy_options({"vocab": "4096.5"}, ["llama-slot"])
    with pytest.raises(KvbenchError, match="--cache-reuse is an option of llama-slot"):
        parse_policy_options({"cache_reuse": "4"}, ["lru"])


def test_token_mode_needs_the_sim_backend():
    t = table([[1, 2]])
    with pytest.raises(KvbenchError, match="only --backend sim"):
        LlamaSlots(prepare(t, BS), 100, {"vocab": 4096})


def test_the_torch_backend_refuses_it_before_any_run(tmp_path):
    """The torch backend stores KV block by block as a policy inserts and evicts; this policy keeps token
    sequences per slot, so the backend refuses it by name, before a run directory exists."""
    from kvbench.run.runner import run_replay

    out = tmp_path / "torch"
    with pytest.raises(KvbenchError, match="--backend sim"):
        run_replay(CHAT, "torch", {"policy": "llama-slot", "capacity": "100"}, out=out, report=False)
    assert not out.exists()
    assert not policies.get("llama-slot").blocks and policies.get("lru").blocks
