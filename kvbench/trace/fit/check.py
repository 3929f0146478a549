"""The self-check of `kvbench trace fit`: which of the fitted statistics a twin gets wrong.

When a twin's hit rates miss the targets, the user needs to know why. Each statistic the model fits is compared
between the trace and its twin as a two-sample Kolmogorov-Smirnov distance (the largest gap between the two
empirical CDFs), and judged against the test's critical value at the 1% level for those sample sizes,
1.628 * sqrt((n + m) / (n m)): a distance above it is more than sampling noise (docs/semantics.md, Fitting a
synthetic twin). The four groups a warning names:

* fan-out: how many blocks a request shares (the prefix tree's depth at which it attaches) and how many earlier
  requests held the prefix it attaches to;
* reuse: how far back the shared prefix was last used, in distinct blocks (LRU stack distance) and in seconds;
* lengths: prompt and output tokens;
* arrivals: arrival times over the trace's span, and gaps between arrivals relative to their mean.
"""

from __future__ import annotations

import numpy as np

INFINITE_TARGET, CURVE_TARGET = 0.02, 0.03
KS_C_1PCT = 1.628  # c(alpha) of the two-sample Kolmogorov-Smirnov test at alpha = 0.01


def ks(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov distance; 0 when either sample is empty."""
    a = np.sort(np.asarray(a, dtype=np.float64)[np.isfinite(a)])
    b = np.sort(np.asarray(b, dtype=np.float64)[np.isfinite(b)])
    if not a.size or not b.size:
        return 0.0
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / a.size
    fb = np.searchsorted(b, grid, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


def critical(n: int, m: int) -> float:
    return KS_C_1PCT * float(np.sqrt((n + m) / (n * m))) if n and m else 1.0


def _samples(st: dict, inp: np.ndarray, out: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    reuse = st["shared"] > 0
    t = st["arrival_s"]
    span = max(float(t[-1] - t[0]), 1e-9) if t.size else 1.0
    gaps = np.diff(t)
    mean_gap = float(gaps.mean()) if gaps.size and gaps.mean() > 0 else 1.0
    return {
        "fan-out": {"shared blocks": st["shared"], "holders of the shared prefix": st["holders"][reuse]},
        "reuse": {"stack distance (blocks)": st["distance_blocks"][reuse], "reuse distance (s)": st["lag_s"][reuse]},
        "lengths": {"prompt tokens": inp, "output tokens": out},
        "arrivals": {"arrival time / span": (t - t[0]) / span, "gap / mean gap": gaps / mean_gap},
    }


def compare(st_orig: dict, orig, st_twin: dict, twin) -> dict:
    """Per statistic: KS distance, its 1% critical value and whether it is off; per group, the worst ratio."""

    def lengths(table):
        return (table.column("input_tokens").to_numpy(), table.column("output_tokens").to_numpy())

    a, b = _samples(st_orig, *lengths(orig)), _samples(st_twin, *lengths(twin))
    out = {}
    for group in a:
        stats = {}
        for name in a[group]:
            x, y = a[group][name], b[group][name]
            d = ks(x, y)
            c = critical(int(np.isfinite(x).sum()), int(np.isfinite(y).sum()))
            stats[name] = {"ks": d, "critical": c, "off": d > c}
        worst = max(stats.values(), key=lambda s: s["ks"] / s["critical"])
        out[group] = {"statistics": stats, "worst_ratio": worst["ks"] / worst["critical"]}
    return out


def verdict(fidelity: dict, statistics: dict) -> str | None:
    """One line when the twin misses a target, naming the statistics that are off (by how far above their
    critical value), or the furthest off when none is; None when the twin meets both targets."""
    inf_gap, curve_gap = fidelity["infinite_cache"]["gap_steady"], fidelity["max_curve_gap_steady"]
    if inf_gap <= INFINITE_TARGET and curve_gap <= CURVE_TARGET:
        return None
    ranked = sorted(statistics, key=lambda g: -statistics[g]["worst_ratio"])
    off = [g for g in ranked if statistics[g]["worst_ratio"] > 1] or ranked[:1]
    named = ", ".join(
        f"{g} ({', '.join(n for n, s in statistics[g]['statistics'].items() if s['off']) or 'nearest the limit'})"
        for g in off
    )
    return (
        f"warning: this twin is not faithful (infinite-cache gap {inf_gap:.3f}, target {INFINITE_TARGET}; curve gap "
        f"{curve_gap:.3f}, target {CURVE_TARGET}); off: {named}. Compare them in the report before using it."
    )
