"""`kvbench experiment`: studies that combine several backends on one trace into one result folder and report
(each subcommand a module of its own, imported when used)."""

from __future__ import annotations

import click

from kvbench.cli import LazyGroup

# each experiment `name` is the command `attribute` of the module kvbench/cli/<module>.py
EXPERIMENTS = {"kv-quant": "kvbench.cli.kv_quant:kv_quant"}


@click.group(cls=LazyGroup, lazy=EXPERIMENTS)
def experiment() -> None:
    """Experiments over a trace: `kv-quant` (KV formats: capacity gained, hit rate, attention error)."""
