"""Reports: a run's report.md and report.html, and the shared page layout of every report."""

from .run import write_reports

__all__ = ["write_reports"]
