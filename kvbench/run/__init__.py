"""Running replays: the backend protocols and their discovery, the runner, run directories and durable
results, sweeps and their executors, comparisons and the demo (docs/architecture.md)."""
