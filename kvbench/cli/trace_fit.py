"""`kvbench trace fit TRACE -o twin.parquet`: fit a model of a trace's prefix reuse, write a synthetic twin, its
parameters as JSON and a report of how close the twin is (docs/semantics.md, Fitting a synthetic twin)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click

from kvbench import options
from kvbench.errors import KvbenchError


def _say(message: str) -> None:
    click.echo(message, err=True)


@dataclasses.dataclass(frozen=True)
class TraceFitOptions:
    """The options of `trace_fit`."""

    out: str | None = options.option(
        None,
        "the twin trace to write (.parquet)",
        unit="path",
        flag=("-o", "--out"),
        type=click.Path(dir_okay=False),
        required=True,
    )
    scale: float = options.option(
        1.0,
        "K: K copies of TRACE's users (K times the units and the arrival rate over the same duration; a fraction "
        "of a copy for a fractional K), each copy with its own block ids and each user behaving as in TRACE (same "
        "turns, same offsets in seconds)",
        unit="unitless",
        type=click.FloatRange(min=0, min_open=True),
    )
    seed: int = options.option(0, "random seed: the same seed gives the same twin", unit="integer", type=int)
    params_path: str | None = options.option(
        None,
        "where to write the fitted parameters (JSON) [default: OUT with .params.json]",
        unit="path",
        flag="--params",
        type=click.Path(dir_okay=False),
    )
    report_dir: str | None = options.option(
        None,
        "folder for report.md and report.html overlaying TRACE and the twin [default: OUT with .report]",
        unit="path",
        flag="--report",
        type=click.Path(file_okay=False),
    )
    fidelity: bool = options.option(
        True,
        "measure the twin against TRACE: infinite-cache and radix-lru token hit rates at 8 capacities (blocks, "
        "1%–100% of TRACE's distinct blocks; K times each for a K-times twin); written into the parameters JSON",
        unit="on/off",
        flag="--fidelity/--no-fidelity",
    )


@click.command("fit")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@options.command_options(TraceFitOptions)
def trace_fit(trace_path, out, scale, seed, params_path, report_dir, fidelity):
    """Fit a synthetic twin to TRACE (block ids and timings only, no text) and write it to OUT.

    The model (docs/semantics.md, Fitting a synthetic twin): the trace cut into units (conversations and task
    trees: requests tied by continuing a whole earlier prompt, or by a session_id, parent_id or depends_on the
    trace names), each kept whole with its requests' offsets, lengths and prefix-tree links (which request's
    prefix, how many blocks of it, how many new blocks); what units share (system prompts, documents) stays
    shared; and when units start. The twin places the units, each once, on the trace's own unit start times,
    exchanging units only with units alike (same tenth of the trace, same root prompt, same octave of new
    blocks) where they still end inside the trace's window; it prints the share of units it moved. --scale K
    makes K copies of the users, each with its own block ids. Salts and LoRA adapters are folded into the block
    ids first, as a replay folds them. The self-check replays TRACE and the twin and
    warns, naming the statistic that is off, when the twin misses its targets (infinite-cache gap 0.02, curve
    gap 0.03).
    """
    from kvbench.cache.prepared import fold_isolation
    from kvbench.report import twin as report
    from kvbench.run import twin as twin_measure
    from kvbench.trace.files import new_meta, write_trace
    from kvbench.trace.fit import check as self_check
    from kvbench.trace.fit import model, synth
    from kvbench.trace.validation import check, read_valid_trace

    started = time.monotonic()
    src = Path(trace_path)
    table, meta = read_valid_trace(src)
    table = table.sort_by([("arrival_s", "ascending")])
    # The structure fitted is the one the cache sees: salts and LoRA adapters folded into the block ids, as a
    # replay folds them (two salted tenants never share a block). The twin carries no salt and needs none.
    table = table.set_column(table.column_names.index("block_hashes"), "block_hashes", fold_isolation(table))
    _say(f"fitting {src} ({table.num_rows:,} requests, block size {meta.block_size})…")
    params, st_orig = model.fit(table, meta.block_size)
    params["source"] = {"trace": str(src), "scale": scale, "seed": seed}

    def progress(done, total):
        _say(f"  twin: copy {done}/{total} of the users")

    _say(f"generating the twin (scale {scale:g}, seed {seed})…")
    slow = scale > 1 and table.num_rows * scale > 5e4  # progress is by copy of the users
    placement: dict = {}
    twin = synth.synthesize(params, scale=scale, seed=seed, progress=progress if slow else None, info=placement)
    # how new the twin is: a trace of few units alike gives a twin close to a renamed copy, and the user should
    # know (docs/semantics.md, What a twin preserves)
    params["placement"] = placement
    _say(f"  {placement['units']:,} units placed, {placement['moved_share']:.0%} of them at another unit's start")
    check(twin, meta.block_size, f"twin of {src}")  # a twin that would not replay is kvbench's bug: say so
    out = Path(out)
    source = {"generator": "trace-fit", "fitted_from": str(src), "scale": scale, "seed": seed}
    write_trace(twin, out, new_meta(meta.block_size, source))
    _say(f"wrote {out} ({twin.num_rows:,} requests)")

    fid = None
    st_twin = model.structure(twin)
    if fidelity:
        _say("self-check: infinite cache and radix-lru at 8 capacities, original and twin…")
        fid = twin_measure.fidelity(table, src, twin, out, meta.block_size, scale)
        fid["statistics"] = self_check.compare(st_orig, table, st_twin, twin)
        warning = self_check.verdict(fid, fid["statistics"])
        fid["faithful"] = warning is None
        params["fidelity"] = fid
        _say(
            f"  infinite-cache gap {fid['infinite_cache']['gap_steady']:.4f} (target {self_check.INFINITE_TARGET}), "
            f"largest curve gap {fid['max_curve_gap_steady']:.4f} (target {self_check.CURVE_TARGET}; token hit rate, "
            "steady state)"
        )
        # the verdict travels with the twin: `kvbench trace info` on it shows whether it was faithful
        source["self_check"] = {
            "infinite_cache_gap": fid["infinite_cache"]["gap_steady"],
            "max_curve_gap": fid["max_curve_gap_steady"],
            "faithful": fid["faithful"],
            "moved_share": placement["moved_share"],
        }
        write_trace(twin, out, new_meta(meta.block_size, source))
        if warning:
            _say(warning)
    params_path = Path(params_path) if params_path else out.with_suffix(".params.json")
    params_path.write_text(json.dumps(params, indent=1) + "\n")
    report_dir = Path(report_dir) if report_dir else out.with_suffix(".report")
    _say("writing the report…")
    try:
        paths = report.write(report_dir, f"Synthetic twin of {src.name}", params, table, twin, st_orig, st_twin, fid)
    except ValueError as exc:
        raise KvbenchError(f"{report_dir}: could not write the report ({exc})") from None
    _say(f"wrote {params_path}, {paths[0]}, {paths[1]} in {time.monotonic() - started:.1f} s")
