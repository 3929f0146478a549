"""Package discovery only (the rest is in pyproject.toml). `kvbench.backends` lives in `backends/` (package-dir
in pyproject.toml), which setuptools' declarative `find` cannot remap, so both trees are found here instead of
kept in a list by hand: a subpackage added later (e.g. engine-sim's scenarios) is in the wheel without anyone
remembering to list it."""

from setuptools import find_packages, setup

setup(
    packages=[
        "kvbench",
        *(f"kvbench.{p}" for p in find_packages("kvbench")),
        "kvbench.backends",
        *(f"kvbench.backends.{p}" for p in find_packages("backends")),
    ]
)
