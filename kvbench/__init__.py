"""kvbench: trace-replay benchmark suite for the KV cache of LLM serving."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvbench")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"
