"""The catalogue of what kvbench models: model geometries (`geometry.py`), accelerators, links and deployments
(`hardware.py`), and the TOML specs that add to them. The cache model converts capacities with a geometry;
engine-sim, the torch backend and the report's answer read the rest."""

from kvbench.models.geometry import KV_DTYPE_BYTES, MODELS, ModelGeometry
from kvbench.models.hardware import (
    DEPLOYMENTS,
    GEMM_TILES,
    HARDWARE,
    WEIGHT_SPLITS,
    Deployment,
    Hardware,
    Specs,
    WeightSplit,
    load_specs,
    resolve_hardware,
    resolve_model,
    weight_split,
)

__all__ = [
    "DEPLOYMENTS",
    "GEMM_TILES",
    "HARDWARE",
    "KV_DTYPE_BYTES",
    "MODELS",
    "WEIGHT_SPLITS",
    "Deployment",
    "Hardware",
    "ModelGeometry",
    "Specs",
    "WeightSplit",
    "load_specs",
    "resolve_hardware",
    "resolve_model",
    "weight_split",
]
