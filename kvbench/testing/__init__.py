"""Fixtures for kvbench's own tests and benchmarks, and for plug-in authors' (an OpenAI-compatible fake server
with fault injection). Nothing in kvbench imports this package at run time; tests/unit/test_layers.py checks."""
