"""The least-squares fits of the measured points and the Calibration values they give: the decode step line
(`decode_step_base_s`, `decode_s_per_kv_token`), the prefill rate that makes the simulator's prefill closest to the
measured TTFTs (`prefill_tokens_per_s`), and for the record the physical fits whose terms the simulator lacks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import KvbenchError
from .plan import DecodePoint, PrefillPoint, Result


@dataclass
class Fit:
    """Least-squares coefficients (named), R² and the number of points."""

    coef: dict[str, float]
    r2: float
    n: int


def least_squares(columns: dict[str, np.ndarray], y: np.ndarray, nonneg: bool = True, relative: bool = True) -> Fit:
    """y ≈ Σ coef[name] × column (a column of ones gives an intercept), least squares of the relative error (weights
    1/y: a 10 ms point counts as much as a 1 s one, so short prompts and small batches are not drowned by the long
    ones) unless `relative` is off. With `nonneg`, a negative coefficient is dropped (set to 0) and the rest refitted:
    step times cannot shrink as work grows. R² is of the plain residuals."""
    names = list(columns)
    y = np.asarray(y, dtype=np.float64)
    w = 1.0 / y if relative and np.all(y > 0) else np.ones_like(y)
    active = list(names)
    while True:
        x = np.column_stack([np.asarray(columns[k], dtype=np.float64) for k in active]) if active else None
        beta = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0] if active else np.zeros(0)
        negative = [k for k, b in zip(active, beta, strict=True) if b < 0]
        if not nonneg or not negative:
            break
        active.remove(min(negative, key=lambda k: beta[active.index(k)]))
    coef = dict.fromkeys(names, 0.0)
    coef.update({k: float(b) for k, b in zip(active, beta, strict=True)})
    pred = sum(coef[k] * np.asarray(columns[k], dtype=np.float64) for k in names)
    return Fit(coef, r_squared(y, pred), len(y))


def r_squared(y, pred) -> float:
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def fit_decode(points: list[DecodePoint]) -> tuple[Fit, Fit]:
    """(step = base + per-KV × KV tokens, step = base + per-sequence × batch + per-KV × KV tokens)."""
    if len(points) < 2:
        raise KvbenchError("the decode fit needs at least two points: give two or more --batch-sizes")
    kv = np.array([p.kv_tokens for p in points])
    b = np.array([p.batch for p in points], dtype=np.float64)
    y = np.array([p.step_s for p in points])
    ones = np.ones_like(y)
    line = least_squares({"base_s": ones, "s_per_kv_token": kv}, y)
    full = least_squares({"base_s": ones, "s_per_seq": b, "s_per_kv_token": kv}, y)
    return line, full


def fit_prefill_physical(points: list[PrefillPoint]) -> Fit:
    """TTFT = overhead + per-token × new tokens + per-pair × attention pairs (DESIGN: a step's linear work and its
    attention), non-negative least squares."""
    if len(points) < 2:
        raise KvbenchError("the prefill fit needs at least two prompt lengths: give two or more --prompt-lengths")
    y = np.array([p.ttft_s for p in points])
    cols = {
        "overhead_s": np.ones_like(y),
        "s_per_token": np.array([p.new_tokens for p in points], dtype=np.float64),
        "s_per_pair": np.array([p.pairs for p in points], dtype=np.float64),
    }
    return least_squares(cols, y)


def fit_prefill_line(points: list[PrefillPoint]) -> Fit:
    """TTFT = a + L / prefill_tokens_per_s over the fresh prompts (no cached context): the issue's straight line."""
    fresh = [p for p in points if p.cached_tokens == 0]
    y = np.array([p.ttft_s for p in fresh])
    return least_squares({"intercept_s": np.ones_like(y), "s_per_token": np.array([p.new_tokens for p in fresh])}, y)


def modeled_prefill_s(new: float, cached: float, tokens_per_s: float, base_s: float, per_kv_s: float) -> float:
    """What the calibrated simulator charges for a prefill of `new` tokens after `cached` ones, alone in a step
    (LatencyModel._cost with a Calibration: the larger of the compute and the memory bound)."""
    return max(new / tokens_per_s, base_s + cached * per_kv_s)


def fit_prefill_rate(points: list[PrefillPoint], base_s: float, per_kv_s: float) -> tuple[float, float]:
    """(tokens/s, R²): the prefill rate whose simulated TTFTs are closest to the measured ones in relative terms
    (golden-section search on log rate). The simulator's prefill of N tokens takes max(N / rate, base + …): the
    rate absorbs the per-request overhead and the attention cost at the measured lengths and contexts."""
    y = np.array([p.ttft_s for p in points])
    new = np.array([p.new_tokens for p in points], dtype=np.float64)
    cached = np.array([p.cached_tokens for p in points], dtype=np.float64)

    def loss(log_rate: float) -> float:
        pred = np.maximum(new / math.exp(log_rate), base_s + cached * per_kv_s)
        return float((((pred - y) / y) ** 2).sum())

    lo, hi = math.log(1.0), math.log(1e9)
    grid = np.linspace(lo, hi, 200)
    best = grid[int(np.argmin([loss(g) for g in grid]))]
    a, b = best - (hi - lo) / 199, best + (hi - lo) / 199
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if loss(c) < loss(d):
            b = d
        else:
            a = c
    rate = math.exp((a + b) / 2)
    pred = np.maximum(new / rate, base_s + cached * per_kv_s)
    return rate, r_squared(y, pred)


@dataclass
class Calibrated:
    """The [calibration] table (Calibration's fields) and what the fits say beside it."""

    prefill_tokens_per_s: float
    decode_step_base_s: float
    decode_s_per_kv_token: float
    fits: dict
    proposed: dict = field(default_factory=dict)

    def calibration(self) -> dict:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_step_base_s": self.decode_step_base_s,
            "decode_s_per_kv_token": self.decode_s_per_kv_token,
        }


def fit(result: Result) -> Calibrated:
    line, full = fit_decode(result.decode)
    base, per_kv = line.coef["base_s"], line.coef["s_per_kv_token"]
    physical = fit_prefill_physical(result.prefill)
    straight = fit_prefill_line(result.prefill)
    rate, rate_r2 = fit_prefill_rate(result.prefill, base, per_kv)
    overhead = max(0.0, physical.coef["overhead_s"] - base)
    fits = {
        "decode_line": {**line.coef, "r2": line.r2, "points": line.n},
        "decode_with_per_seq": {**full.coef, "r2": full.r2, "points": full.n},
        "prefill_line": {
            "intercept_s": straight.coef["intercept_s"],
            "tokens_per_s": 1 / straight.coef["s_per_token"] if straight.coef["s_per_token"] > 0 else math.inf,
            "r2": straight.r2,
            "points": straight.n,
        },
        "prefill_physical": {**physical.coef, "r2": physical.r2, "points": physical.n},
        "prefill_rate": {"tokens_per_s": rate, "r2": rate_r2, "points": len(result.prefill)},
    }
    # Terms the simulator's Calibration lacks, at the values these measurements give them (a proposal):
    proposed = {
        # outside the engine's step loop (HTTP, the API server, the hand-off to the engine core): TTFT's fixed part
        # less one step's fixed cost; paid once per request, added to its TTFT, occupies no engine step
        "request_overhead_s": overhead,
        # a prefill step's work: linear layers per new token, attention per (query, key) pair, added to the step's
        # fixed cost (on a CPU nothing overlaps: the step is the sum, not the roofline's max)
        "prefill_s_per_token": physical.coef["s_per_token"],
        "prefill_s_per_pair": physical.coef["s_per_pair"],
        # a decode step's cost per running sequence (sampling, output processing), beside its KV term
        "decode_s_per_seq": full.coef["s_per_seq"],
    }
    return Calibrated(rate, base, per_kv, fits, proposed)
