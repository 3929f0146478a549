"""engine-sim refuses a malformed size (--hbm-capacity, --dram, --ssd, --global-pool) when it is built, before any
replay, naming the option."""

from __future__ import annotations

import pytest
from kvbench.backends.enginesim import EngineSimBackend

from kvbench.errors import KvbenchError


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("hbm_capacity", "1.5", "--hbm-capacity '1.5' is not a whole number of blocks"),
        ("hbm_capacity", "99999999999999999999", "--hbm-capacity '99999999999999999999' is more than"),
        ("dram", "lots", "--dram 'lots' is not understood"),
        ("ssd", "-1GB", "--ssd '-1GB' is not understood"),
        ("global_pool", "1e999", "--global-pool '1e999' is more than"),
    ],
)
def test_bad_sizes_are_refused_at_construction(option, value, message):
    with pytest.raises(KvbenchError) as err:
        EngineSimBackend(**{option: value})
    assert message in str(err.value)


def test_no_tier_and_good_sizes_are_accepted():
    EngineSimBackend(hbm_capacity="5000", dram="64GiB", ssd="0", global_pool="")
