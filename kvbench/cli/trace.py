"""`kvbench trace …`: generate, import, export, inspect and validate workload traces."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import click

from kvbench import options
from kvbench.cli import LazyGroup
from kvbench.cli.render import console, info_markdown, print_info
from kvbench.errors import KvbenchError
from kvbench.registry import Registry
from kvbench.trace import generators, importers
from kvbench.trace.export import EXPORTERS
from kvbench.trace.files import read_meta, write_trace
from kvbench.trace.scan import trace_info_file, validate_file
from kvbench.trace.stats import DEFAULT_WARMUP
from kvbench.trace.validation import check, read_valid_trace

# The subcommands kept in modules of their own, imported when used; the others are defined below.
SUBCOMMANDS: Registry[click.Command] = Registry(None, "trace command")
SUBCOMMANDS.add_lazy("anonymize", "kvbench.cli.trace_anonymize:anonymize_command")
SUBCOMMANDS.add_lazy("fit", "kvbench.cli.trace_fit:trace_fit")
SUBCOMMANDS.add_lazy("record", "kvbench.cli.trace_record:record")


@click.group(cls=LazyGroup, registry=SUBCOMMANDS)
def trace() -> None:
    """Create and inspect workload traces (Parquet, schema v1)."""


# --- gen: one subcommand per registered generator, options built from its parameter dataclass ----------


@dataclasses.dataclass(frozen=True)
class GenOptions:
    """The options every `kvbench trace gen KIND` takes before its generator's parameters."""

    n: int = options.option(
        1000, "number of requests to generate", unit="requests", flag=("-n", "--requests"), type=click.IntRange(min=1)
    )
    seed: int = options.option(
        0, "random seed; same parameters and seed give an identical trace", unit="integer", type=int
    )
    block_size: int = options.option(
        generators.DEFAULT_BLOCK_SIZE,
        "tokens per hash block (the cache's block/page size)",
        unit="tokens",
        type=click.IntRange(min=1),
    )
    out: str | None = options.option(
        None,
        "output Parquet file [default: KIND-nN-sSEED.parquet]",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False),
    )


def _gen_command(gen: generators.Generator) -> click.Command:
    def run(n, seed, block_size, out, **params):
        out = Path(out or f"{gen.name}-n{n}-s{seed}.parquet")
        with console.status(f"generating {n:,} {gen.name} requests"):
            # validated as it is written: a generator bug must never yield a file
            rows = gen.write(out, n, seed=seed, block_size=block_size, **params)
        click.echo(f"wrote {out} ({rows:,} requests, block size {block_size})")

    params = options.cli_options(GenOptions) + options.cli_options(gen.params_type)
    if gen.stream is not None:
        memory = "Written window by window in bounded memory, for any -n (the same trace as in one piece)."
    else:
        memory = (
            f"Built in memory (~{gen.bytes_per_request / 1000:.0f} KB a request at peak); "
            "a count that would not fit in the free memory is refused."
        )
    help = f"{gen.summary}\n\n{memory} The trace is validated as it is written."
    return click.Command(gen.name, callback=run, params=params, help=help, short_help=gen.summary)


class _GenGroup(click.Group):
    def list_commands(self, ctx):
        return list(generators.registry())

    def get_command(self, ctx, name):
        gens = generators.registry()
        return _gen_command(gens[name]) if name in gens else None


@trace.group(cls=_GenGroup)
def gen() -> None:
    """Generate a seeded synthetic trace of one workload kind (see `kvbench trace gen KIND --help`)."""


# --- import / export ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImportOptions:
    """The options of every `import` command (each format adds its own: `Importer.options`)."""

    out: str = options.option(
        None, "output Parquet trace", unit="path", flag=("-o", "--out"), type=click.Path(dir_okay=False), required=True
    )


def _import_command(imp: importers.Importer) -> click.Command:
    def run(src, out, **given):
        given = {k: v for k, v in given.items() if v is not None}
        with console.status(f"importing {src}") as status:
            if "progress" in inspect.signature(imp.read).parameters:  # a slow reader says how far it is

                def progress(done, total, what):
                    status.update(f"importing {src}: {what}, {done / max(total, 1):.0%}")

                given["progress"] = progress
            if imp.write is not None:  # batch by batch, validated as it is written
                rows = imp.write(Path(src), Path(out), **given)
            else:
                table, meta = imp.read(Path(src), **given)
                check(table, meta.block_size, str(src))
                write_trace(table, out, meta)
                rows = table.num_rows
        click.echo(f"wrote {out} ({rows:,} requests, block size {read_meta(out).block_size})")

    params = [
        click.Argument(["src"], type=click.Path(exists=True)),
        *options.cli_options(ImportOptions),
        *options.cli_options(imp.options),
    ]
    return click.Command(
        imp.name,
        callback=run,
        params=params,
        short_help=imp.summary,
        help=f"{imp.summary}\n\n"
        + ("Read and written batch by batch, in bounded memory. " if imp.write is not None else "Read in memory. ")
        + "The result is validated before it is written.",
    )


class _ImportGroup(click.Group):
    def list_commands(self, ctx):
        return list(importers.registry())

    def get_command(self, ctx, name):
        imps = importers.registry()
        return _import_command(imps[name]) if name in imps else None


@trace.group("import", cls=_ImportGroup)
def import_() -> None:
    """Convert a public trace into a kvbench trace: `kvbench trace import FORMAT SRC -o OUT.parquet`."""


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """The options of `export`."""

    fmt: str = options.option(
        "mooncake",
        "target format (mooncake JSONL is read by AIPerf, `vllm bench serve` and GuideLLM)",
        unit="name",
        flag="--format",
        type=click.Choice(list(EXPORTERS)),
    )
    out: str | None = options.option(
        None,
        "output file [default: TRACE with .jsonl]",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False),
    )
    renumber: bool = options.option(
        False,
        "renumber block ids 0,1,2,… by first appearance (some replayers expect small ids)",
        unit="on/off",
        is_flag=True,
    )


@trace.command("export")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@options.command_options(ExportOptions)
def export(trace_path, fmt, out, renumber):
    """Write a kvbench trace in another tool's format."""
    table, meta = read_valid_trace(trace_path)
    out = Path(out or Path(trace_path).with_suffix(".jsonl"))
    EXPORTERS[fmt](table, meta, out, renumber=renumber)
    click.echo(f"wrote {out} ({table.num_rows:,} requests, {fmt}, block size {meta.block_size})")


@dataclasses.dataclass(frozen=True)
class RebaseOptions:
    """The options of `rebase`."""

    block_size: int | None = options.option(
        None,
        "the engine's KV block size in tokens (vLLM's --block-size, e.g. 16 or 32); any size, it need not "
        "divide the trace's",
        unit="tokens",
        type=click.IntRange(min=1),
        required=True,
    )
    out: str | None = options.option(
        None,
        "output trace (.parquet): TRACE's rows with block_hashes at --block-size tokens a block",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False),
        required=True,
    )


@trace.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@options.command_options(RebaseOptions)
def rebase(trace_path, block_size, out):
    """Re-cut TRACE's block ids at an engine's block size, so that the simulator predicts what that engine
    can hit.

    The new ids come from the prompts a live replay of TRACE sends (text synthesised from the block ids, media
    spans from each item's content hash): two blocks get the same id exactly when the prompts hold the same
    tokens from their start to the end of that block, as the engine's prefix cache sees them. Live replays use
    the original TRACE: its prompts are those tokens.
    """
    from kvbench.live.prompts import rebase_blocks
    from kvbench.trace.files import new_meta
    from kvbench.trace.scan import trace_fingerprint

    table, meta = read_valid_trace(trace_path)
    try:
        hashes = rebase_blocks(table, meta.block_size, block_size)
    except ValueError as exc:
        raise KvbenchError(f"{trace_path}: {exc}") from None
    source = {**meta.source, "rebased_from": trace_fingerprint(table), "rebased_block_size": block_size}
    table = table.set_column(table.schema.get_field_index("block_hashes"), "block_hashes", hashes)
    write_trace(table, out, new_meta(block_size, source))
    click.echo(f"wrote {out} ({table.num_rows:,} requests, block size {meta.block_size} -> {block_size})")


# --- info / validate ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InfoOptions:
    """The options of `info`."""

    as_json: bool = options.option(
        False,
        "print the statistics as JSON (stable keys)",
        unit="on/off",
        flag="--json",
        is_flag=True,
    )
    warmup: float = options.option(
        DEFAULT_WARMUP,
        "fraction of requests (by arrival) excluded from the steady-state hit rate",
        unit="fraction",
        type=click.FloatRange(0, 1, max_open=True),
    )
    markdown: str | None = options.option(
        None,
        "also write the statistics as a Markdown report",
        unit="path",
        type=click.Path(dir_okay=False),
    )


@trace.command()
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@options.command_options(InfoOptions)
def info(trace_path, as_json, warmup, markdown):
    """Counts, duration, rates, length percentiles, per-workload/tenant breakdowns, unique blocks and the
    infinite-cache prefix hit rate (all requests and steady state)."""
    with console.status("validating and computing statistics"):
        stats = trace_info_file(trace_path, warmup)
    meta = read_meta(trace_path)
    stats = {"trace": str(trace_path), "source": meta.source, **stats}
    if markdown:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(info_markdown(stats))
    if as_json:
        click.echo(json.dumps(stats, indent=2))
    else:
        print_info(stats)
        if markdown:
            click.echo(f"report written to {markdown}")


@dataclasses.dataclass(frozen=True)
class ValidateOptions:
    """The options of `validate`."""

    as_json: bool = options.option(False, "print every violation as JSON", unit="on/off", flag="--json", is_flag=True)


@trace.command()
@click.argument("paths", metavar="TRACE…", nargs=-1, required=True, type=click.Path())
@options.command_options(ValidateOptions)
def validate(paths, as_json):
    """Check traces against schema v1; lists every violation by column and row. Gives a verdict for every
    TRACE, readable or not; exits 1 if any is invalid, 2 if any cannot be read."""
    verdicts = []  # (path, report or None, why it could not be read)
    for path in paths:  # read by row group: a trace of any length validates in bounded memory
        try:
            verdicts.append((path, validate_file(path), None))
        except KvbenchError as exc:  # unreadable or not a kvbench trace: its verdict, then the next file
            verdicts.append((path, None, str(exc)))
    if as_json:
        rows = []
        for path, r, unreadable in verdicts:
            if r is None:
                rows.append({"source": str(path), "rows": None, "ok": False, "error": unreadable, "violations": []})
            else:
                violations = [dataclasses.asdict(v) for v in r.violations]
                rows.append({"source": r.source, "rows": r.rows, "ok": r.ok, "violations": violations})
        click.echo(json.dumps(rows, indent=2))
    else:
        for path, r, unreadable in verdicts:
            click.echo(r.summary() if r is not None else _unreadable_verdict(path, unreadable))
    unreadable = sum(r is None for _, r, _ in verdicts)
    if unreadable:
        click.secho(f"error: {unreadable} of {len(verdicts)} trace(s) could not be read", fg="red", err=True)
        raise SystemExit(2)
    if not all(r.ok for _, r, _ in verdicts):
        raise SystemExit(1)


def _unreadable_verdict(path, message: str) -> str:
    """'PATH: cannot be read: why' (the reading errors name the file first already: not twice)."""
    why = message.removeprefix(f"{path}: ")
    return f"{path}: cannot be read: {why}"
