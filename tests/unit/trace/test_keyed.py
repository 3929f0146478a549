"""Properties of the keyed block ids (kvbench/trace/keyed.py), checked with hypothesis on random prompts: the
prefix rule every cache backend relies on, no sharing across keys, and re-keying that keeps sharing exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvbench.errors import KvbenchError
from kvbench.trace.keyed import KEY_ENV, block_ids, hash_key, rekey

KEY = hash_key(environ={KEY_ENV: "a secret"})
# A small alphabet makes long shared prefixes (and equal blocks in different places) common in random draws.
tokens = st.lists(st.integers(min_value=0, max_value=3), max_size=40)
sizes = st.integers(min_value=1, max_value=6)
secrets = st.text(min_size=1, max_size=20).filter(lambda s: "\x00" not in s)  # an environment variable holds no NUL


@settings(max_examples=300, deadline=None)
@given(common=tokens, a=tokens, b=tokens, bs=sizes)
def test_prefix_rule_ids_equal_exactly_where_tokens_are(common, a, b, bs):
    """Blocks 0..k-1 of two prompts have equal ids iff the prompts' first k*bs tokens are equal (a partial last
    block counts as its own tokens: it equals only the same partial block)."""
    x, y = common + a, common + b
    ix, iy = block_ids(x, bs, KEY), block_ids(y, bs, KEY)
    assert ix.dtype == np.uint64 and len(ix) == -(-len(x) // bs) and len(iy) == -(-len(y) // bs)
    for k in range(1, min(len(ix), len(iy)) + 1):
        assert (ix[:k] == iy[:k]).all() == (x[: k * bs] == y[: k * bs])


@settings(max_examples=200, deadline=None)
@given(x=tokens, y=tokens, bs=sizes)
def test_an_id_is_equal_only_with_the_same_prefix(x, y, bs):
    """Equal ids anywhere (not only at the same position) mean the same whole prefix: the chain ties a block
    to everything before it, so a block repeated later in a prompt gets a new id."""
    ix, iy = block_ids(x, bs, KEY), block_ids(y, bs, KEY)
    for i, u in enumerate(ix):
        for j, v in enumerate(iy):
            if u == v:
                assert x[: (i + 1) * bs] == y[: (j + 1) * bs]


@settings(max_examples=200, deadline=None)
@given(x=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), bs=sizes, s1=secrets, s2=secrets)
def test_different_keys_share_no_ids(x, bs, s1, s2):
    assume(s1 != s2)
    a = block_ids(x, bs, hash_key(environ={KEY_ENV: s1}))
    b = block_ids(x, bs, hash_key(environ={KEY_ENV: s2}))
    assert not set(a.tolist()) & set(b.tolist())  # the same prompt, nothing in common across keys
    assert (a == block_ids(x, bs, hash_key(environ={KEY_ENV: s1}))).all()  # and the same key gives the same ids


@settings(max_examples=200, deadline=None)
@given(
    picks=st.lists(st.integers(0, 9), min_size=1, max_size=60),
    pool=st.lists(st.integers(0, 2**64 - 1), min_size=10, max_size=10, unique=True),
    secret=secrets,
)
def test_rekey_keeps_equality_structure(picks, pool, secret):
    ids = np.asarray([pool[p] for p in picks], dtype=np.uint64)
    new = rekey(ids, hash_key(environ={KEY_ENV: secret}))
    assert new.shape == ids.shape and new.dtype == np.uint64
    assert ((ids[:, None] == ids[None, :]) == (new[:, None] == new[None, :])).all()
    assert (new == rekey(ids, hash_key(environ={KEY_ENV: secret}))).all()


@settings(max_examples=100, deadline=None)
@given(x=tokens, bs=sizes, secret=secrets)
def test_rekeyed_trace_keeps_the_prefix_rule(x, bs, secret):
    """Re-keying two prompts' ids together leaves shared leading blocks shared and the rest apart."""
    y = x[: len(x) // 2] + [9] * 5
    ix, iy = block_ids(x, bs, KEY), block_ids(y, bs, KEY)
    both = rekey(np.concatenate([ix, iy]), hash_key(environ={KEY_ENV: secret}))
    rx, ry = both[: len(ix)], both[len(ix) :]
    assert ((ix[:, None] == iy[None, :]) == (rx[:, None] == ry[None, :])).all()


@pytest.mark.parametrize("environ", [{}, {KEY_ENV: ""}])
def test_hash_key_refuses_a_missing_or_empty_variable(environ):
    with pytest.raises(KvbenchError, match=f"set {KEY_ENV}"):
        hash_key(environ=environ)


@given(s1=secrets, s2=secrets)
def test_hash_key_is_a_stable_64_byte_key_per_secret(s1, s2):
    k1 = hash_key(environ={KEY_ENV: s1})
    assert len(k1) == 64 and k1 == hash_key(environ={KEY_ENV: s1})
    assert (k1 == hash_key(environ={KEY_ENV: s2})) == (s1 == s2)


def test_hash_key_reads_the_named_variable():
    assert hash_key("OTHER", environ={"OTHER": "x"}) == hash_key(environ={KEY_ENV: "x"})


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        block_ids([1, 2], 0, KEY)
