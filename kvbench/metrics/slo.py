"""Latency targets as users write them (`--slo ttft=500,tpot=50`, in milliseconds), read into the keys that
summary.json's latency records use. Goodput (kvbench/metrics/latency.py) and the SLO view of fairness
(kvbench/metrics/fairness.py) both take their targets from here."""

from __future__ import annotations

from kvbench.errors import KvbenchError

SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


def parse_slo(text: str | None, option: str = "--slo") -> dict[str, float]:
    """'ttft=500,tpot=50' (milliseconds) -> {"ttft_ms": 500.0, "tpot_ms": 50.0}; errors name `option`."""
    slo = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, _, value = part.partition("=")
        key = key.strip().lower().removesuffix("_ms")
        if key not in SLO_KEYS:
            raise KvbenchError(f"{option} {part!r}: use ttft=MS, tpot=MS or e2el=MS, e.g. ttft=500,tpot=50")
        try:
            slo[SLO_KEYS[key]] = float(value)
        except ValueError:
            raise KvbenchError(f"{option} {part!r}: {value!r} is not a number of milliseconds") from None
    return slo
