"""`kvbench trace fit`: a synthetic twin of a trace from a fitted model of its prefix reuse (model.py), generated
at any scale (synth.py), with its fidelity measured against the trace (report.py)."""

from kvbench.trace.fit.model import fit, structure
from kvbench.trace.fit.synth import synthesize

__all__ = ["fit", "structure", "synthesize"]
