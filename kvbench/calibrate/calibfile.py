"""The calibration file: a TOML text with a comment header (how to use it), the [calibration] table that
`kvbench replay --backend engine-sim --calibration FILE` reads and a [measurements] table with every raw point and
fit. Written by hand (the standard library reads TOML but does not write it), checked with tomllib before it lands."""

from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path

from .fitting import Calibrated
from .plan import Result


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


def render(result: Result, cal: Calibrated, command: str | None = None) -> str:
    """The calibration file's text: a comment header, [calibration], [measurements]."""
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    f = cal.fits
    overhead_ms = cal.proposed.get("request_overhead_s", 0.0) * 1e3
    header = [
        f"# kvbench calibration of {result.model!r} at {result.url}, measured {created} in {result.seconds:.0f} s.",
        "# Use it with the engine simulator, beside the hardware and model it stands in for, e.g. the local vLLM CPU",
        "# engine:",
        "#   kvbench replay TRACE --backend engine-sim --hardware cpu --model kvbench-tiny --calibration THIS_FILE",
        "# (with that engine's scheduler limits, --max-num-seqs 128 --max-num-batched-tokens 2048 on CPU, and its KV",
        "# pool, --hbm-capacity BLOCKS; [measurements.server] has the block count where the server reports it).",
        "#",
        "# [calibration] replaces the roofline's terms (backends/enginesim/roofline.py, Calibration):",
        "#   prefill_tokens_per_s   the rate whose simulated prefill, max(N / rate, base + P × per-KV) for N new",
        "#                          tokens after P cached, is closest to the measured TTFTs: it folds in the",
        "#                          per-request overhead and the attention cost at the measured mix, which the",
        "#                          simulator lacks",
        "#   decode_step_base_s     intercept of decode step time against the batch's KV tokens (streamed ITL)",
        "#   decode_s_per_kv_token  slope of that line",
        "# Terms the simulator cannot take yet are in [measurements.proposed]: request_overhead_s (TTFT's fixed",
        f"# part less one step's: {overhead_ms:.1f} ms here), the cost per attention (query, key) pair, a",
        "# per-sequence decode cost. The raw points and every fit with its R² are in [measurements].",
    ]
    if command:
        header.append(f"# Command: {command}")
    meas = {
        "url": result.url,
        "model": result.model,
        "endpoint": result.endpoint,
        "max_model_len": result.max_model_len,
        "seconds": round(result.seconds, 1),
        "repeats": result.plan.repeats,
        "seed": result.plan.seed,
        "server": result.server or None,
        "warnings": result.warnings or None,
        "fits": f,
        "proposed": cal.proposed or None,
        "prefill": [
            {
                "cached_tokens": p.cached_tokens,
                "new_tokens": p.new_tokens,
                "ttft_s": p.ttft_s,
                "samples_s": p.samples_s,
                "server_cached_tokens": p.server_cached_tokens,
            }
            for p in result.prefill
        ],
        "decode": [
            {
                "batch": p.batch,
                "prompt_tokens": p.context_tokens,
                "kv_tokens": round(p.kv_tokens, 1),
                "step_s": p.step_s,
                "samples_s": p.samples_s,
                "window_steps": p.window_steps,
            }
            for p in result.decode
        ],
    }
    body = _table("calibration", cal.calibration()) + _table("measurements", meas)
    return "\n".join(header) + "\n\n" + "\n".join(body).rstrip() + "\n"


def write(path: str | Path, result: Result, cal: Calibrated, command: str | None = None) -> Path:
    path = Path(path)
    text = render(result, cal, command)
    import tomllib

    tomllib.loads(text)  # never write a file the simulator cannot read
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    tmp.replace(path)
    return path
