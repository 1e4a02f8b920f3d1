"""Every experiment by name, in the order `knnper experiment --help` lists them."""

from __future__ import annotations

from experiments import base_model, capacity, folded, hardware, heterogeneity, k_sigma, lambda_vs_n
from experiments.spec import Experiment

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    heterogeneity.EXPERIMENT,
    capacity.EXPERIMENT,
    hardware.EXPERIMENT,
    base_model.EXPERIMENT,
    lambda_vs_n.EXPERIMENT,
    k_sigma.EXPERIMENT,
    folded.SHIFT_EXPERIMENT,
    folded.GRID_EXPERIMENT,
)}
