"""torch backend: the cost of replaying a trace's block stream against real pools (compute off), per copy
mode, and the host-side transfer rate it reaches, for the history. One run of the same workload through the
`sim` backend is the same-run reference: the ratio says what the data movement adds to the bookkeeping."""

from __future__ import annotations

from kvbench.trace import generators

REQUESTS = 500
OPTIONS = dict(capacity="1500", dram_capacity="3000", ssd_capacity="12000")


class TorchReplay:
    params = ["block", "coalesced", "staged"]
    param_names = ["copy_mode"]
    timeout = 300

    def setup(self, copy_mode):
        self.table, self.meta = generators.get("chat").run(REQUESTS, seed=3)

    def _replay(self, copy_mode):
        from kvbench.backends.torchkv import TorchBackend

        (point,) = TorchBackend(copy_mode=copy_mode, **OPTIONS).replay(self.table, self.meta)
        return point

    def time_500_requests_three_tiers(self, copy_mode):
        self._replay(copy_mode)

    def track_hbm_to_dram_gb_per_s(self, copy_mode):
        """Rate of HBM → DRAM write-backs ("HBM" is host memory on a CPU run)."""
        return self._replay(copy_mode).extra["torch"]["transfers"]["hbm->dram"]["gb_per_s"]

    track_hbm_to_dram_gb_per_s.unit = "GB/s"

    def track_vs_sim_time_ratio(self, copy_mode):
        """torch / sim wall time on the same trace and capacity, in one run (the machine is noisy)."""
        import time

        from kvbench.backends.sim import SimBackend

        t0 = time.perf_counter()
        list(
            SimBackend(policy="lru", capacity=OPTIONS["capacity"], bound=False, reference=True).replay(
                self.table, self.meta
            )
        )
        sim = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._replay(copy_mode)
        return (time.perf_counter() - t0) / sim

    track_vs_sim_time_ratio.unit = "ratio"
