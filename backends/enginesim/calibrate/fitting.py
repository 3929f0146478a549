"""The fit: one non-negative least squares over every measured point (prefill TTFTs and decode step times) for the
six terms of the engine simulator's `Calibration`, in relative error; then how well it fits (R² overall and per
row kind, every point's residual), what each term is worth (its share of the modeled time, an approximate standard
error) and the verdict: a poor fit is an error unless forced."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from kvbench.backends.enginesim.calibrate.design import TERMS, Design, prefill_row
from kvbench.backends.enginesim.calibrate.joining import join_window
from kvbench.backends.enginesim.calibrate.plan import Result
from scipy.optimize import nnls

from kvbench.errors import KvbenchError

DEFAULT_MIN_R2 = 0.9
DEFAULT_MAX_MEDIAN_ERROR = 0.15  # median |modeled − measured| / measured of either row kind
WORST_SHOWN = 3  # worst points a poor-fit message names per row kind


def r_squared(y, pred) -> float:
    """1 − SS_res / SS_tot of the plain (unweighted) residuals; 1.0 for a perfect fit of constant data."""
    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    ss_tot = float(((y - y.mean()) ** 2).sum())
    ss_res = float(((y - pred) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def relative_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """β ≥ 0 minimising Σ ((x·β − y) / y)²: a 10 ms point counts as much as a 1 s one, so short prompts and small
    batches are not drowned by the long ones; no term may be negative, since no work makes a step quicker."""
    weighted = x / y[:, None]
    # columns span ~15 orders of magnitude (a count of 1 beside tens of millions of pairs): solve in unit columns
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    beta, _ = nnls(weighted / norms, np.ones_like(y), maxiter=50 * x.shape[1])
    return beta / norms


def standard_errors(x: np.ndarray, y: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """Approximate standard errors of β: the unconstrained weighted least-squares formula σ²(AᵀA)⁻¹ with A = x / y
    and σ² the relative residuals' variance, at the fitted β. An approximation: it ignores the non-negativity
    bound (a term held at 0 gets the error it would have if free) and treats the points' medians as independent."""
    a = x / y[:, None]
    residual = a @ beta - 1.0
    dof = max(len(y) - int(np.count_nonzero(beta)), 1)
    sigma2 = float(residual @ residual) / dof
    # scale columns before inverting, for the same reason as in the fit
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    cov = np.linalg.pinv((a / norms).T @ (a / norms)) * sigma2
    return np.sqrt(np.clip(np.diag(cov), 0.0, None)) / norms


@dataclass
class Calibrated:
    """The fitted terms (the [calibration] table) and how well they fit the points."""

    terms: dict[str, float]
    stderr: dict[str, float]
    share: dict[str, float]  # each term's part of the modeled time summed over all points
    r2: float
    r2_prefill: float
    r2_decode: float
    median_error_prefill: float  # median |relative residual| of the prefill rows
    median_error_decode: float
    measured_s: list[float]  # per point (the medians), prefill rows first, as Design orders them
    modeled_s: list[float]
    residual: list[float]  # (modeled − measured) / measured, per point
    labels: list[str]
    n_prefill: int
    forced: bool = False
    warnings: list[str] = field(default_factory=list)  # why the fit is poor, when forced
    folded: tuple[str, ...] = ()  # terms fixed at 0 because the server's steps cannot show them (Design.folded)
    join_window_s: float = 0.0  # measured apart from the fit (joining.py), not a term of the step sum
    join_warnings: list[str] = field(default_factory=list)
    join_lone_prefill_s: float = 0.0  # the fitted prefill of one join prompt, which says whether a pair joined

    def calibration(self) -> dict:
        """The [calibration] table: the six terms, and the join window."""
        return {**{t: self.terms[t] for t in TERMS}, "join_window_s": self.join_window_s}

    def quality(self) -> dict:
        """The fit's figures, as the file and --json record them."""
        return {
            "r2": self.r2,
            "r2_prefill": self.r2_prefill,
            "r2_decode": self.r2_decode,
            "median_abs_residual_prefill": self.median_error_prefill,
            "median_abs_residual_decode": self.median_error_decode,
            "points_prefill": self.n_prefill,
            "points_decode": len(self.residual) - self.n_prefill,
            "forced": self.forced,
            **({"folded": list(self.folded)} if self.folded else {}),
        }


def fit_terms(result: Result) -> Calibrated:
    """The six terms from the run's points, and the fit's figures; raises if the points cannot tell them apart."""
    design = Design.of(result)
    design.identifiability()
    x, y, prefill = design.x, design.y, design.is_prefill
    beta = np.zeros(x.shape[1])
    beta[design.free] = relative_nnls(x[:, design.free], y)  # a folded term stays 0 (Design.folded)
    stderr = np.zeros(x.shape[1])
    stderr[design.free] = standard_errors(x[:, design.free], y, beta[design.free])
    modeled = x @ beta
    contributions = (x * beta).sum(axis=0)
    total = float(modeled.sum())
    residual = (modeled - y) / y
    overhead = float(beta[TERMS.index("request_overhead_s")])
    lone = float(prefill_row(result.plan.join_tokens, 0, result.plan.max_num_batched_tokens) @ beta) - overhead
    window, join_warnings = join_window(result.join, lone, overhead)
    return Calibrated(
        terms={t: float(b) for t, b in zip(TERMS, beta, strict=True)},
        stderr={t: float(e) for t, e in zip(TERMS, stderr, strict=True)},
        share={t: float(c / total) if total > 0 else 0.0 for t, c in zip(TERMS, contributions, strict=True)},
        r2=r_squared(y, modeled),
        r2_prefill=r_squared(y[prefill], modeled[prefill]),
        r2_decode=r_squared(y[~prefill], modeled[~prefill]),
        median_error_prefill=float(np.median(np.abs(residual[prefill]))),
        median_error_decode=float(np.median(np.abs(residual[~prefill]))),
        measured_s=[float(v) for v in y],
        modeled_s=[float(v) for v in modeled],
        residual=[float(v) for v in residual],
        labels=design.labels(),
        n_prefill=design.n_prefill,
        folded=design.folded,
        join_window_s=window,
        join_warnings=join_warnings,
        join_lone_prefill_s=lone,
    )


def problems(cal: Calibrated, min_r2: float, max_median_error: float) -> list[str]:
    """What is wrong with the fit, one line per bad row kind with its worst points; [] for a good fit."""
    out = []
    kinds = (
        ("prefill", cal.r2_prefill, cal.median_error_prefill, range(cal.n_prefill)),
        ("decode", cal.r2_decode, cal.median_error_decode, range(cal.n_prefill, len(cal.residual))),
    )
    for kind, r2, error, rows in kinds:
        bad = []
        if r2 < min_r2:
            bad.append(f"R² {r2:.3f} < {min_r2:g}")
        if error > max_median_error:
            bad.append(f"median |residual| {error:.1%} > {max_median_error:.0%}")
        if not bad:
            continue
        worst = sorted(rows, key=lambda i: -abs(cal.residual[i]))[:WORST_SHOWN]
        shown = "; ".join(
            f"{cal.labels[i]}: measured {_ms(cal.measured_s[i])}, modeled "
            f"{_ms(cal.modeled_s[i])} ({cal.residual[i]:+.0%})"
            for i in worst
        )
        out.append(f"{kind} rows fit badly ({', '.join(bad)}); worst: {shown}")
    return out


def judge(
    cal: Calibrated, min_r2: float = DEFAULT_MIN_R2, max_median_error: float = DEFAULT_MAX_MEDIAN_ERROR, force=False
) -> Calibrated:
    """`cal` if it fits well; if not, a KvbenchError that says which rows fit badly and what to do, or with
    `force` the same `cal` marked forced, its warnings saying why."""
    found = problems(cal, min_r2, max_median_error)
    if not found:
        return cal
    if not force:
        raise KvbenchError(
            "the step model fits the measurements poorly, so no calibration file was written: "
            + " | ".join(found)
            + ". Calibrate while nothing else runs on the machine or the server (other load makes step times "
            "jump), raise --repeats (medians of more samples), or pass --force to write the file anyway (it then "
            "records forced = true and this warning)"
        )
    cal.forced, cal.warnings = True, found
    return cal


def fit(
    result: Result,
    min_r2: float = DEFAULT_MIN_R2,
    max_median_error: float = DEFAULT_MAX_MEDIAN_ERROR,
    force: bool = False,
) -> Calibrated:
    """`fit_terms` then `judge`: the calibration of a run, or a KvbenchError when it fits poorly (unless forced)."""
    return judge(fit_terms(result), min_r2, max_median_error, force)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
