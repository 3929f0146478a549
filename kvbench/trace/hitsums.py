"""What a trace's own scan sums (kvbench/trace/scan.py, summary.py) and every hit-rate metric builds on
(kvbench/metrics/hits.py): token and block hit rates over all requests and over the steady state, kept as sums
chunk by chunk, and the label of requests without a tenant or workload."""

from __future__ import annotations

import numpy as np

NO_LABEL = "(none)"  # the group of requests without a tenant / workload


def _ratio(num: int, den: int) -> float:
    return float(num) / float(den) if den else 0.0


class HitSums:
    """Token and block hit rates over all requests and over the steady state (rows from `steady_from` on):
    the `stats.hit_rates` dict, from sums kept chunk by chunk."""

    def __init__(self, steady_from: int, warmup: float):
        self.steady_from, self.warmup, self.rows = steady_from, warmup, 0
        # [all, steady] sums of hit tokens, input tokens, hit blocks, blocks
        self.sums = np.zeros((2, 4), dtype=object)  # Python ints: exact whatever the trace length

    def add(self, hit_tokens, input_tokens, hit_blocks, n_blocks) -> None:
        """The next rows' per-request values (int64 arrays of one length)."""
        cut = min(max(self.steady_from - self.rows, 0), len(input_tokens))
        for i, values in enumerate((hit_tokens, input_tokens, hit_blocks, n_blocks)):
            self.sums[0, i] += int(values.sum())
            self.sums[1, i] += int(values[cut:].sum())
        self.rows += len(input_tokens)

    def rates(self) -> dict:
        (ht, it, hb, nb), (s_ht, s_it, s_hb, s_nb) = self.sums.tolist()
        return {
            "token": {"all": _ratio(ht, it), "steady": _ratio(s_ht, s_it)},
            "block": {"all": _ratio(hb, nb), "steady": _ratio(s_hb, s_nb)},
            "warmup": self.warmup,
        }
