"""What went wrong in a live run, counted: requests by status (ok, failed, timeout, cancelled, not sent), the
most common error classes, and the verdict against `--max-failure-rate`. The terminal, summary.json and the
report all show this one record, so they never disagree."""

from __future__ import annotations

from collections import Counter

from kvbench.errors import KvbenchError
from kvbench.metrics.latency import error_class

TOP_ERRORS = 5
DEFAULT_MAX_FAILURE_RATE = 0.0  # any failed request fails the run unless the user allows some


class TooManyFailures(KvbenchError):
    """The run finished and kept its results, but more requests failed than --max-failure-rate allows."""

    exit_code = 3


def failure_summary(status: list[str], errors: list[str | None]) -> dict:
    """Counts by status and the top error classes of a live run's requests (their `status` and `error`)."""
    counts = Counter(status)
    total = len(status)
    unsent = counts["not_sent"] + counts["cancelled"]
    # error, timeout, and whatever else was sent and not answered (a distributed run's worker_lost)
    failed = [e for s, e in zip(status, errors) if s not in ("ok", "not_sent", "cancelled")]
    n_failed = len(failed)
    sent = total - unsent
    return {
        "requests": total,
        "ok": counts["ok"],
        "failed": n_failed,
        "timeout": counts["timeout"],
        "cancelled": counts["cancelled"],
        "not_sent": counts["not_sent"],
        "failure_rate": n_failed / sent if sent else None,
        "top_errors": [
            {"error": k, "count": v}
            for k, v in Counter(error_class(e) or "unknown" for e in failed).most_common(TOP_ERRORS)
        ],
    }


def describe(failures: dict) -> str:
    """One terminal line: '40 requests: 37 ok, 3 failed (1 timeout), 0 not sent; HTTP 500 ×2, timeout ×1'."""
    line = (
        f"{failures['requests']} requests: {failures['ok']} ok, {failures['failed']} failed "
        f"({failures['timeout']} timeout), {failures['not_sent'] + failures['cancelled']} not sent"
    )
    if failures["top_errors"]:
        line += "; " + ", ".join(f"{e['error']} ×{e['count']}" for e in failures["top_errors"])
    return line


def check_failure_rate(failures: dict, max_rate: float) -> None:
    """Raise TooManyFailures when the run's failure share exceeds `max_rate` (or nothing was answered)."""
    rate = failures["failure_rate"]
    if failures["ok"] == 0 and failures["requests"] > 0:
        raise TooManyFailures(f"no request succeeded ({describe(failures)}); see the error column of requests.parquet")
    if rate is not None and rate > max_rate:
        raise TooManyFailures(
            f"{rate:.1%} of sent requests failed, more than --max-failure-rate {max_rate:g} allows "
            f"({describe(failures)}); the results are kept, see the error column of requests.parquet"
        )
