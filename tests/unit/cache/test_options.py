"""The sim backend refuses every bad option when it is built, before any replay, naming the option."""

from __future__ import annotations

import pytest
from kvbench.backends.sim import SimBackend

from kvbench.errors import KvbenchError


@pytest.mark.parametrize(
    "options,message",
    [
        ({"capacity": ""}, "--capacity '' gives no capacity"),
        ({"capacity": " , "}, "gives no capacity"),
        ({"capacity": "100,,200"}, "empty item"),
        ({"capacity": "1.5"}, "--capacity '1.5' is not a whole number of blocks"),
        ({"capacity": "99999999999999999999"}, "more than the 1,000,000,000,000 blocks"),
        ({"capacity": "1e999999"}, "more than the"),
        ({"capacity": "0"}, "--capacity '0' is less than one block"),
        ({"capacity": "-5"}, "--capacity '-5' is not understood"),
        ({"capacity": "40GiB"}, "pass --model"),
        ({"capacity": "10 parsecs"}, "unknown unit"),
        ({"policy": "", "capacity": "10"}, "--policy '' names no policy"),
        ({"policy": "nope", "capacity": "10"}, "unknown policy 'nope'"),
        ({"capacity": "10", "quota": "a=0.5"}, "--quota is an option of tenant-quota; --policy lru does not use it"),
        ({"capacity": "10", "small_fraction": "0.2"}, "--small-fraction is an option of s3fifo"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "a"}, "item 'a' is not tenant=share"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": ""}, "--quota ''"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "a=nan"}, "tenant 'a' has 'nan'"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "a=-0.1"}, "a quota is a number >= 0"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "a=2.5"}, "a quota above 1 is whole blocks"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "a=1,a=2"}, "gives tenant 'a' twice"),
        ({"policy": "tenant-quota", "capacity": "10", "quota": "missing.toml"}, "--quota 'missing.toml': no such file"),
        ({"policy": "s3fifo", "capacity": "10", "small_fraction": "1.5"}, "--small-fraction '1.5' must be <= 1 (share of the capacity"),
        ({"policy": "s3fifo", "capacity": "10", "small_fraction": "inf"}, "--small-fraction 'inf' must be a finite"),
        ({"policy": "priority-lru", "capacity": "10", "priority_duration_s": "-1"}, "--priority-duration-s '-1'"),
        ({"policy": "priority-lru", "capacity": "10", "priority_duration_requests": "2.5"}, "'2.5' must be a whole number (requests)"),
        (
            {"policy": "priority-lru", "capacity": "10", "priority_duration_s": "1", "priority_duration_requests": "1"},
            "not both",
        ),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(KvbenchError) as err:
        SimBackend(**options)
    assert message in str(err.value)


@pytest.mark.parametrize("body", ["[1, 2]", "not json", '{"a": "lots"}'])
def test_a_bad_quota_file_is_refused(tmp_path, body):
    path = tmp_path / "q.json"
    path.write_text(body)
    with pytest.raises(KvbenchError, match="--quota '.*q.json'"):
        SimBackend(policy="tenant-quota", capacity="10", quota=str(path))


def test_good_options_are_kept():
    sim = SimBackend(policy="tenant-quota,lru", capacity="1.5k,5M tok", quota="a=0.5,*=200")
    assert sim.policy_options == {"quota": {"a": 0.5, "*": 200.0}}
    assert SimBackend(policy="s3fifo", capacity="10", small_fraction="0.25").policy_options == {"small_fraction": 0.25}
