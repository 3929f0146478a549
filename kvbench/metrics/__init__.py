"""The metrics layer (docs/architecture.md, Layers): how hit rates, latency, fairness, saturation and failures
are defined and computed from per-request records. It reads the trace layer only; every backend, the runner and
the report take their metrics from here, so a metric has one definition whatever produced the records."""
