"""`kvbench trace anonymize`: a trace made fit to publish, its cache behaviour unchanged
(`kvbench.trace.anonymize`; docs/semantics.md, Anonymizing a trace)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from kvbench import options
from kvbench.cli.render import console
from kvbench.errors import KvbenchError
from kvbench.trace.anonymize import ANON_KEY_ENV, anon_key, anonymize
from kvbench.trace.files import write_trace
from kvbench.trace.schema import conform
from kvbench.trace.validation import check, read_valid_trace


@dataclasses.dataclass(frozen=True)
class AnonymizeCommandOptions:
    """The options of `anonymize_command`."""

    out: str | None = options.option(
        None,
        "output trace (.parquet); an existing file is refused unless --force",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False),
        required=True,
    )
    key_env: str = options.option(
        ANON_KEY_ENV,
        "environment variable holding the secret (any text) that ids and names are hashed with; never stored. "
        "The same secret gives the same pseudonyms across traces, a different one shares nothing",
        unit="name",
        metavar="NAME",
    )
    round_s: float | None = options.option(
        None,
        "round arrival times to the nearest multiple of SECONDS (e.g. 1 or 60): hides exact timing; changes "
        "the pacing of a timed replay, not the hits of an offline one [default: keep exact times]",
        unit="s",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
    )
    force: bool = options.option(False, "overwrite OUT if it exists", unit="on/off", is_flag=True)


@click.command("anonymize")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@options.command_options(AnonymizeCommandOptions)
def anonymize_command(trace_path, out, key_env, round_s, force):
    """Write TRACE with every identifier replaced, fit to publish.

    Block ids and media hashes are re-keyed with the secret in --key-env (blocks shared stay shared); request,
    parent, user, session and tenant ids, LoRA adapter names and cache salts become keyed pseudonyms such as
    tenant-3f9a…; columns outside the schema and provenance that could name the source (file names, time
    origin) are dropped, and the metadata records `anonymized: true` and what was done. Hit rates at every
    capacity are unchanged. The input and the output are both validated; read in memory.
    """
    out = Path(out)
    if out.exists() and not force:
        raise KvbenchError(f"{out}: exists; pass --force to overwrite it")
    key = anon_key(key_env)  # before reading: a missing secret fails at once, not after a long read
    with console.status(f"anonymizing {trace_path}"):
        table, meta = read_valid_trace(trace_path)
        result = anonymize(table, meta, key, round_s=round_s)
        new = conform(result.table)
        check(new, meta.block_size, str(out))  # an anonymizer bug must never yield a file
        write_trace(new, out, result.meta)
    dropped = f"; dropped columns {', '.join(result.dropped_columns)}" if result.dropped_columns else ""
    click.echo(
        f"wrote {out} ({new.num_rows:,} requests; block ids re-keyed; pseudonyms for "
        f"{', '.join(result.pseudonymized) or 'no id columns'}{dropped}"
        + (f"; arrivals rounded to {round_s:g} s" if round_s else "")
        + ")"
    )
