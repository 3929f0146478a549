"""The cache model every backend shares: eviction policies (compiled kernels and readable references), the
trace prepared for them, tiers below HBM, capacities and the one-pass hit-rate curve (docs/architecture.md)."""
