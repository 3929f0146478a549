"""`kvbench experiment kv-quant TRACE --memory 16GiB --model llama3-8b`: what each KV format buys in capacity and
costs in attention accuracy, on one trace (docs/kv-quantization.md). For every format: bytes per token with its
scales, the blocks that fit the memory, the sim backend's hit rate at that many blocks (one `run_replay` of the
trace, every capacity a point), and the attention output's relative error against bf16 on the trace's longest
requests, by decode position; optionally a mixed policy (older blocks in fewer bits) as one more row."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import click

from kvbench import options
from kvbench.cache.capacity import parse_size
from kvbench.errors import KvbenchError
from kvbench.models import MODELS
from kvbench.run.rundir import RunDir, stamp

DEFAULT_FORMATS = "bf16,fp8,int8,fp4,int4,int2"


def _formats(spec: str) -> list:
    from kvbench.backends.torchkv.quantization import kv_format

    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise KvbenchError("--kv-dtypes names no format; e.g. --kv-dtypes bf16,fp8,int4")
    if len(set(names)) < len(names):
        raise KvbenchError(f"--kv-dtypes {spec!r} names a format twice")
    return [kv_format(n) for n in names]


def run_kv_quant(trace_path, memory: str, model: str, *, kv_dtypes: str = DEFAULT_FORMATS, group_size: int = 32,
                 key_grouping: str = "channel", value_grouping: str = "token", kv_dtype: str = "int4",
                 kv_dtype_old: str | None = None, kv_old_after_tokens: int = 4096, policy: str = "lru",
                 error_settings=None, out=None, overwrite: bool = False, plots: bool = True,
                 command: str | None = None):  # fmt: skip
    """The experiment as a function: (run directory, result dict). Every option is checked before the run
    directory is claimed."""
    from kvbench.backends.torchkv.kv_quant_report import write_reports
    from kvbench.backends.torchkv.quant_error import ErrorSettings, measure, pick_requests
    from kvbench.backends.torchkv.quantization import MixedPolicy, bytes_per_token, check_group, kv_format
    from kvbench.backends.torchkv.synthetic_kv import SyntheticKv

    from kvbench.run.runner import run_replay
    from kvbench.trace.validation import read_valid_trace

    if model not in MODELS:
        raise KvbenchError(f"--model {model!r}: unknown; choose one of {', '.join(MODELS)}")
    geometry = MODELS[model]
    if geometry.mla:
        raise KvbenchError(f"--model {model}: MLA caches one latent, not K and V; choose a model with K/V heads")
    if "," in policy:
        raise KvbenchError(f"--policy {policy!r}: give one eviction policy (the hit rates compare formats)")
    memory_bytes = parse_size(memory, "--memory")
    formats = _formats(kv_dtypes)
    recent = kv_format(kv_dtype, "--kv-dtype")  # checked even without --kv-dtype-old: a typo is never ignored
    check_group(group_size, geometry.head_dim, key_grouping, "--group-size")
    check_group(group_size, geometry.head_dim, value_grouping, "--group-size")
    settings = error_settings or ErrorSettings()
    settings = type(settings)(**{**settings.__dict__, "group": group_size, "key_axis": key_grouping,
                                 "value_axis": value_grouping})  # fmt: skip
    trace_path = Path(trace_path)
    table, meta = read_valid_trace(trace_path)
    T = meta.block_size
    mixed = None
    if kv_dtype_old is not None:
        mixed = MixedPolicy(recent, kv_format(kv_dtype_old, "--kv-dtype-old"),
                            kv_old_after_tokens, T)  # fmt: skip
    lengths = [i + o for i, o in zip(table["input_tokens"].to_pylist(), table["output_tokens"].to_pylist())]
    bf16 = bytes_per_token(geometry, kv_format("bf16"), group_size)
    entries = [{"format": f.name, "label": f.name, "bytes_per_token": bytes_per_token(geometry, f, group_size)}
               for f in formats]  # fmt: skip
    if mixed is not None:
        entries.append({"format": "mixed", "label": mixed.label, "mixed": True,
                        "bytes_per_token": mixed.bytes_per_token(geometry, group_size, lengths)})  # fmt: skip
    for e in entries:
        e["blocks"] = int(memory_bytes // (e["bytes_per_token"] * T))
        if e["blocks"] < 1:
            raise KvbenchError(f"--memory {memory}: less than one {T}-token block of {model} in {e['label']}")
        e["capacity_gain"] = float(bf16 / e["bytes_per_token"])
        e["bytes_per_token"] = float(e["bytes_per_token"])
    columns = ["request_id", "input_tokens", "output_tokens", "block_hashes"]
    rows = pick_requests(table.select(columns).to_pylist(), settings)  # refuses a trace with nothing to measure
    run_dir = RunDir.claim(out, Path("reports") / f"{stamp()}-kv-quant-{trace_path.stem}", overwrite=overwrite,
                           what="kv-quant run", resumable=False)  # fmt: skip
    try:
        capacities = ",".join(str(b) for b in sorted({e["blocks"] for e in entries}))
        _, summary = run_replay(trace_path, "sim", {"policy": policy, "capacity": capacities, "bound": False},
                                out=run_dir.path / "sim", command=f"{command} (its hit-rate run)")  # fmt: skip
        hit = {p["capacity_blocks"]: p["hit_rate"]["token"]["all"] for p in summary["points"]}
        for e in entries:
            e["hit_rate"] = hit[e["blocks"]]
        age_format = mixed.old if mixed is not None else kv_format("int2")
        errors = measure(SyntheticKv(geometry, T, settings.seed), rows, formats, mixed, age_format, settings)
    except BaseException:
        run_dir.discard()
        raise
    result = {
        "command": command or "run_kv_quant",
        "trace": str(trace_path),
        "settings": {"model": model, "memory": memory, "memory_bytes": memory_bytes, "block_tokens": T,
                     "group_size": group_size, "key_grouping": key_grouping, "value_grouping": value_grouping,
                     "policy": policy, **({"mixed": mixed.label} if mixed else {}),
                     **{k: v for k, v in settings.__dict__.items() if k not in ("group", "key_axis", "value_axis")}},
        "table": entries,
        "errors": errors,
    }  # fmt: skip
    if mixed is not None:
        result["mixed_note"] = (
            f"Mixed row: blocks whose every token is ≥ {mixed.old_after_tokens} tokens behind the newest are "
            f"{mixed.old.name} (requantized from {mixed.recent.name}), the rest {mixed.recent.name}; its bytes per "
            "token average over the trace's requests at their full length (prompt + output), and the sim holds "
            "blocks of that mean size."
        )
    partial = run_dir.path / "kv_quant.json.partial"  # renamed into place: a killed run never leaves half a file
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(run_dir.path / "kv_quant.json")
    write_reports(run_dir.path, result, plots)
    return run_dir.path, result


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise KvbenchError("--device cuda: no CUDA device here; use --device cpu (or auto)")
    return device


def _names(ctx, param, value):
    return value.strip() if value is not None else value


@dataclasses.dataclass(frozen=True)
class KvQuantOptions:
    """The options of `kv_quant`."""

    memory: str | None = options.option(
        None,
        "KV memory the cache may use, e.g. 16GiB or 40GB",
        unit="bytes (B, KB/MB/GB, KiB/MiB/GiB)",
        required=True,
    )
    model: str | None = options.option(
        None,
        "model geometry: layers, KV heads, head dim",
        unit="name",
        type=click.Choice([m for m in MODELS if not MODELS[m].mla]),
        required=True,
    )
    kv_dtypes: str = options.option(
        DEFAULT_FORMATS,
        "formats compared, comma-separated (bf16, fp8, int8, fp4, int4, int2)",
        unit="names",
        callback=_names,
    )
    group_size: int = options.option(
        32,
        "elements sharing one scale (and zero point): along a token's head vector they must divide head_dim",
        unit="elements",
        type=int,
    )
    key_grouping: str = options.option(
        "channel",
        "keys' groups: one channel over consecutive tokens (KIVI) or a token's channels",
        unit="name",
        type=click.Choice(["channel", "token"]),
    )
    value_grouping: str = options.option(
        "token",
        "values' groups, as --key-grouping",
        unit="name",
        type=click.Choice(["token", "channel"]),
    )
    kv_dtype_old: str | None = options.option(
        None,
        "add a mixed row: blocks older than --kv-old-after-tokens in this format",
        unit="name",
    )
    kv_dtype: str = options.option("int4", "the mixed row's format for recent blocks", unit="name")
    kv_old_after_tokens: int = options.option(
        4096,
        "a block turns old when its newest token is this far behind the sequence's newest",
        unit="tokens",
        type=int,
    )
    policy: str = options.option("lru", "eviction policy of the hit-rate run", unit="name")
    max_context: int = options.option(
        8192,
        "tokens of K/V generated per measured request at most (prompt + decode)",
        unit="tokens",
        type=click.IntRange(min=2),
    )
    n_requests: int = options.option(
        4,
        "requests measured: those with the longest outputs",
        unit="count",
        flag="--requests",
        type=click.IntRange(min=1),
    )
    layers: int = options.option(
        1,
        "layers measured, evenly spaced from the first to the last",
        unit="count",
        type=click.IntRange(min=1),
    )
    buckets: int = options.option(
        8,
        "decode-position buckets of the error table",
        unit="count",
        type=click.IntRange(min=1),
    )
    queries_per_bucket: int = options.option(
        8,
        "query positions per request and bucket",
        unit="count",
        type=click.IntRange(min=1),
    )
    age_parts: int = options.option(
        4,
        "slices of the context in the key-age sensitivity",
        unit="count",
        type=click.IntRange(min=1),
    )
    seed: int = options.option(0, "seed of the generative K/V", unit="integer", type=int)
    device: str = options.option(
        "auto",
        "where quantization and attention run: cuda when a GPU is present (auto), else cpu; K/V are "
        "drawn on the CPU generator either way, so both give the same K/V",
        unit="name",
        type=click.Choice(["auto", "cpu", "cuda"]),
    )
    out: str | None = options.option(
        None,
        "run directory; one that holds something is refused unless --overwrite "
        "[default: reports/<time>-kv-quant-<trace>]",
        unit="path",
        type=click.Path(file_okay=False),
    )
    overwrite: bool = options.option(False, "replace what --out holds", unit="on/off", is_flag=True)
    plots: bool = options.option(
        True,
        "draw the report's plot (matplotlib)",
        unit="on/off",
        flag="--plots/--no-plots",
        show_default=False,
    )


@click.command("kv-quant")
@click.argument("trace_path", metavar="TRACE", type=click.Path(exists=True, dir_okay=False))
@options.command_options(KvQuantOptions)
def kv_quant(trace_path, memory, model, kv_dtypes, group_size, key_grouping, value_grouping, kv_dtype_old, kv_dtype,
             kv_old_after_tokens, policy, max_context, n_requests, layers, buckets, queries_per_bucket, age_parts,
             seed, device, out, overwrite, plots):  # fmt: skip
    """KV formats on one trace: capacity gained (blocks that fit --memory), the sim's hit rate there, and the
    attention error against bf16 by decode position (docs/kv-quantization.md)."""
    from kvbench.backends.torchkv.kv_quant_report import markdown_table
    from kvbench.backends.torchkv.quant_error import ErrorSettings

    settings = ErrorSettings(max_context=max_context, requests=n_requests, layers=layers, buckets=buckets,
                             queries_per_bucket=queries_per_bucket, age_parts=age_parts, seed=seed,
                             device=resolve_device(device))  # fmt: skip
    run_dir, result = run_kv_quant(
        trace_path, memory, model, kv_dtypes=kv_dtypes, group_size=group_size, key_grouping=key_grouping,
        value_grouping=value_grouping, kv_dtype=kv_dtype, kv_dtype_old=kv_dtype_old,
        kv_old_after_tokens=kv_old_after_tokens, policy=policy, error_settings=settings, out=out,
        overwrite=overwrite, plots=plots, command="kvbench " + shlex.join(sys.argv[1:]),
    )  # fmt: skip
    click.echo(markdown_table(result))
    click.echo(f"run: {run_dir}")
