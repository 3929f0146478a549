"""The calibration file: a TOML text with a comment header (how to use it), the [calibration] table that
`kvbench replay --backend engine-sim --calibration FILE` reads (exactly `Calibration`'s six terms and the join
window) and a [measurements] table with the endpoint (host:port only), the plan, the server's facts, the fit's
figures, every term's share and standard error, and every point measured and modeled. Written by hand (the
standard library reads TOML but does not write it), checked with tomllib before it lands."""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path

from kvbench.backends.enginesim.calibrate.design import PER, TERMS, Design
from kvbench.backends.enginesim.calibrate.fitting import Calibrated
from kvbench.backends.enginesim.calibrate.plan import Result


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return '"' + str(v) + '"'
        return repr(float(f"{v:.6g}"))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def _table(name: str, d: dict) -> list[str]:
    lines, sub = [f"[{name}]"], []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, dict):
            sub.append((k, v))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            sub.append((k, v))
        else:
            lines.append(f"{k} = {_toml_value(v)}")
    out = lines + [""]
    for k, v in sub:
        if isinstance(v, dict):
            out += _table(f"{name}.{k}", v)
        else:
            for row in v:
                out += [f"[[{name}.{k}]]"] + [f"{a} = {_toml_value(b)}" for a, b in row.items() if b is not None] + [""]
    return out


def _header(result: Result, cal: Calibrated, command: str | None) -> list[str]:
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    chunk = result.plan.max_num_batched_tokens
    lines = [
        f"# kvbench calibration of {result.model!r} at {result.url}, measured {created} in {result.seconds:.0f} s.",
        "# Use it with the engine simulator, beside the hardware and model it stands in for, e.g. the local vLLM CPU",
        "# engine:",
        "#   kvbench replay TRACE --backend engine-sim --hardware cpu --model kvbench-tiny --calibration THIS_FILE",
        "# with the engine's scheduler limits (vLLM's CPU defaults: --max-num-seqs 128 --max-num-batched-tokens 2048;",
        f"# this calibration modeled the server's prefills as chunks of {chunk} tokens, one step each) and its KV",
        "# pool, --hbm-capacity BLOCKS ([measurements.server] has the block count where the server reports it).",
        "#",
        "# [calibration] replaces the roofline (backends/enginesim/roofline.py, Calibration): an engine step costs",
        "#   step_overhead_s + s_per_seq·seqs + s_per_token·tokens + s_per_pair·pairs + s_per_kv_token·kv_read",
        "# and every request waits request_overhead_s before it reaches the scheduler (part of its TTFT). All terms",
        "# are seconds (per request, step, sequence, token, attention (query, key) pair, cached KV token read),",
        "# fitted jointly by non-negative least squares of the relative error over every measured point: a prefill",
        "# TTFT is the request overhead plus its chunk steps, a decode point one step of the batch.",
        "# join_window_s (measured apart, [[measurements.join]]): an idle engine's first step also takes the requests",
        "# that arrive up to this long after the first one (pairs sent a set offset apart, prefilled together or not);",
        "# it is part of request_overhead_s, so a lone request's TTFT stays the same.",
        f"# Fit: R² {cal.r2:.3f} overall, {cal.r2_prefill:.3f} on the prefill points, "
        f"{cal.r2_decode:.3f} on the decode points;",
        "# [measurements.fit] and [measurements.terms] have the details, [[measurements.prefill]] and",
        "# [[measurements.decode]] every point measured and modeled.",
    ]
    if cal.forced:
        lines += ["#", "# FORCED (--force): the fit is poor, use these terms with care:"]
        lines += [f"#   {w}" for w in cal.warnings]
    if command:
        lines.append(f"# Command: {command}")
    return lines


def render(result: Result, cal: Calibrated, command: str | None = None) -> str:
    """The calibration file's text: a comment header, [calibration], [measurements]."""
    design = Design.of(result)
    modeled, residual = cal.modeled_s, cal.residual
    n = len(result.prefill)
    meas = {
        "url": result.url,
        "model": result.model,
        "endpoint": result.endpoint,
        "max_model_len": result.max_model_len,
        "seconds": round(result.seconds, 1),
        "forced": cal.forced,
        "fit_warnings": cal.warnings or None,
        "warnings": result.warnings or None,
        "join_warnings": cal.join_warnings or None,
        "plan": result.plan.record(),
        "server": result.server or None,
        "fit": {
            **cal.quality(),
            "method": "non-negative least squares of (modeled - measured) / measured over all points' medians",
            "prefill_row": "TTFT = request_overhead_s + sum over the prefill's chunk steps",
            "decode_row": "step = one step of `batch` sequences holding `kv_tokens` (pairs = kv_tokens + batch)",
        },
        "terms": {
            t: {
                "value": cal.terms[t],
                "unit": f"s per {PER[t]}",
                "share": cal.share[t],
                "stderr": cal.stderr[t],
            }
            for t in TERMS
        },
        "terms_note": "share: the term's part of the modeled time summed over all points; stderr: approximate (the "
        "unconstrained weighted least-squares formula at the fit, ignoring the bound at 0)",
        "prefill": [
            {
                "cached_tokens": p.cached_tokens,
                "new_tokens": p.new_tokens,
                "chunks": design.chunks[i],
                "ttft_s": p.ttft_s,
                "modeled_s": modeled[i],
                "residual": residual[i],
                "samples_s": p.samples_s,
                "server_cached_tokens": p.server_cached_tokens,
            }
            for i, p in enumerate(result.prefill)
        ],
        "decode": [
            {
                "batch": p.batch,
                "prompt_tokens": p.context_tokens,
                "kv_tokens": round(p.kv_tokens, 1),
                "step_s": p.step_s,
                "modeled_s": modeled[n + i],
                "residual": residual[n + i],
                "samples_s": p.samples_s,
                "window_steps": p.window_steps,
            }
            for i, p in enumerate(result.decode)
        ],
        "join_lone_prefill_s": cal.join_lone_prefill_s if result.join else None,
        "join": [p.record(cal.join_lone_prefill_s) for p in result.join] or None,
    }
    body = _table("calibration", cal.calibration()) + _table("measurements", meas)
    return "\n".join(_header(result, cal, command)) + "\n\n" + "\n".join(body).rstrip() + "\n"


def write(path: str | Path, result: Result, cal: Calibrated, command: str | None = None) -> Path:
    """Write the file whole or not at all: checked with tomllib, written beside the target and renamed over it,
    so that an error on the way never leaves a partial file (nor touches an earlier one)."""
    import tomllib

    path = Path(path)
    text = render(result, cal, command)
    tomllib.loads(text)  # never write a file the simulator cannot read
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
