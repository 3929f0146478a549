"""Built-in kvbench backends, installed as the `kvbench.backends` package.

Each backend module registers itself in pyproject.toml under the `kvbench.backends` entry-point group,
exactly as a third-party backend would; the core finds them through `kvbench.run.plugins`, never by import.
"""

if __name__ == "backends":  # imported from a source checkout as a top-level package
    # Two names for one module would give two policy registries and clashing numba caches.
    raise ImportError("import kvbench.backends (the installed name), not the top-level 'backends' folder")
