"""The committed sample traces: one per kind, small, valid, and made by the recipe next to them."""

import re

import pytest

from kvbench.trace.files import read_trace
from kvbench.trace.generators import get, registry
from kvbench.trace.validation import validate_table
from tests.conftest import SAMPLES

RECIPE = re.findall(r"trace gen (\S+)\s+-n (\d+)\s+--seed (\d+)\s+-o \$out/(\S+)", (SAMPLES / "recipe.sh").read_text())


def test_recipe_makes_one_sample_of_every_registered_kind():
    kinds = [kind for kind, *_ in RECIPE]
    assert sorted(kinds) == sorted(registry())  # a new generator needs its sample, each kind has one


@pytest.mark.parametrize("kind, n, seed, name", RECIPE)
def test_sample_is_small_valid_and_matches_its_recipe(kind, n, seed, name):
    path = SAMPLES / name
    assert path.stat().st_size < 1_000_000
    table, meta = read_trace(path)
    assert validate_table(table, meta.block_size, source=str(path)).ok
    assert table.num_rows == int(n)
    assert meta.source["generator"] == kind and meta.source["seed"] == int(seed)
    # The recorded parameters are the generator's current defaults, so the recipe still describes the file.
    defaults = get(kind).params_type()
    assert meta.source["params"] == {k: getattr(defaults, k) for k in meta.source["params"]}


@pytest.mark.parametrize("kind, n, seed, name", RECIPE)
def test_sample_regenerates_identically(kind, n, seed, name):
    import numpy as np

    table, meta = read_trace(SAMPLES / name)
    recorded = meta.source["numpy"].split(".")[:2]
    if recorded != np.__version__.split(".")[:2]:
        pytest.skip(f"sample made with numpy {meta.source['numpy']}, this is {np.__version__}")
    regenerated, _ = get(kind).run(int(n), seed=int(seed), block_size=meta.block_size)
    assert table.equals(regenerated), f"{kind} output changed: if intended, rerun traces/samples/recipe.sh"
