"""Report rendering (asv): `kvbench.report.write_reports(run_dir, summary)`, i.e. report.md and report.html
(matplotlib plots as inline SVG) of a finished run.

The run is built once in `setup` (not timed): `kvbench.run.runner.run_replay` of the chat sample
(traces/samples/chat.parquet, 2,000 requests) through the `sim` backend with `POLICIES` x `CAPACITIES`,
the Belady bound beside them and the one-pass curve (`--curve`), without the report. One untimed
`write_reports` call then imports matplotlib, so that `time_write_reports` is the rendering alone.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "traces/samples/chat.parquet"
POLICIES = "lru,radix-lru,vllm"
CAPACITIES = "1000,4000,16000"  # blocks


class Report:
    number = 1
    repeat = (2, 5, 30.0)
    timeout = 300

    def setup(self):
        from kvbench.report import write_reports
        from kvbench.run.runner import run_replay

        self.tmp = Path(tempfile.mkdtemp(prefix="kvb-bench-report-"))
        options = {"policy": POLICIES, "capacity": CAPACITIES, "curve": True}
        self.run_dir, self.summary = run_replay(TRACE, "sim", options, out=self.tmp / "run", report=False)
        self.write_reports = write_reports
        write_reports(self.run_dir, self.summary)  # warm-up: matplotlib import, font cache

    def teardown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def time_write_reports(self):
        self.write_reports(self.run_dir, self.summary)
