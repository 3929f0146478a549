"""Built-in kvbench backends, installed as the `kvbench.backends` package.

Each backend module registers itself in pyproject.toml under the `kvbench.backends` entry-point group,
exactly as a third-party backend would; the core finds them through `kvbench.plugins`, never by import.
"""
