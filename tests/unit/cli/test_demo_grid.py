"""The demo's optional protocol: a backend joins `kvbench demo` by declaring a demo grid (`DemoGrid`)."""

from __future__ import annotations

from kvbench.cli.demo_run import demo_backends
from kvbench.run.backend import DemoGrid


class WithGrid:
    kind = "offline"

    @classmethod
    def demo_options(cls, trace, meta) -> dict:
        return {"policy": ("lru",)}


class WithoutGrid:
    kind = "offline"


def test_a_class_with_demo_options_is_a_demo_grid():
    assert issubclass(WithGrid, DemoGrid)
    assert not issubclass(WithoutGrid, DemoGrid)


def test_the_demo_takes_the_built_in_simulators_and_no_live_backend():
    names = demo_backends()
    assert {"sim", "engine-sim"} <= set(names)
    assert "openai" not in names
