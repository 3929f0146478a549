"""Integration tests against real engines started by `kvbench engine up` (see .ci/start-engines)."""


def pytest_configure(config):
    # pyproject's marker list belongs to others; this one is registered here.
    config.addinivalue_line(
        "markers",
        "engine: needs a real serving engine started by `kvbench engine up` (.ci/start-engines); skipped when "
        "none runs, unless KVBENCH_REQUIRE_ENGINES is set",
    )
