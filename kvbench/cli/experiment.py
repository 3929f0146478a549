"""`kvbench experiment`: studies that combine several backends on one trace into one result folder and report.
Each is a click command that a backend declares under the `kvbench.experiments` entry points (the torch
backend's `kv-quant`), imported when used: the core lists them and depends on no backend."""

from __future__ import annotations

import click

from kvbench.cli import LazyGroup
from kvbench.registry import Registry

EXPERIMENTS: Registry[click.Command] = Registry(None, "experiment", group="kvbench.experiments")


@click.group(cls=LazyGroup, registry=EXPERIMENTS)
def experiment() -> None:
    """Experiments: `kv-quant` (KV formats on a trace: capacity gained, hit rate, attention error) and `attn-ffn`
    (attention/FFN disaggregation: tokens/s per device and TPOT against the attention:FFN device ratio)."""
