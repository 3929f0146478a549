"""Point names carry their units."""

from kvbench.run.backend import PointResult
from kvbench.run.pointnames import point_name


def test_each_number_carries_the_unit_its_key_names():
    assert PointResult({"policy": "lru", "capacity_blocks": 1000}).name == "lru/1000blocks"
    assert point_name({"policy": "vllm", "instances": 2}) == "vllm/2instances"
    assert point_name({"policy": "lru"}) == "lru" and point_name({"point": "live"}) == "live"
    assert point_name({"policy": "lru", "capacity": "4GiB"}) == "lru/4GiB"  # text is kept as written
