"""`kvbench compare RUN RUN…`: side-by-side tables and the sim-vs-live fidelity gap."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the tables as JSON")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="also write the tables to this .md file")
def compare(runs, as_json, out):
    """Put run directories side by side: hit rates, TTFT/TPOT/ITL/E2EL percentiles (ms), throughput
    (requests/s) and failures; for runs of the same trace, the predicted (sim) vs measured (live) hit rate and
    the share of requests whose predicted hit tokens equal the server's cached_tokens."""
    from ..compare import compare as run_compare
    from ..compare import render_markdown

    result = run_compare(list(runs))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    text = "## Runs\n\n" + render_markdown(result["runs"])
    if result["fidelity"]:
        text += "\n\n## Fidelity: predicted vs measured\n\n" + render_markdown(result["fidelity"])
    click.echo(text)
    if out:
        out.write_text(text + "\n")
