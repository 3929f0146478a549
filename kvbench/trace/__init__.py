"""The trace layer: the schema, reading and writing trace files, validation, bounded-memory scans and
statistics, and the generators, importers and exporters that make and convert traces (docs/architecture.md)."""
