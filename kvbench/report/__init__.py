"""Reports: a run's report.md and report.html, and the shared page layout of every report."""

from kvbench.report.run import rewrite_reports, write_reports

__all__ = ["rewrite_reports", "write_reports"]
