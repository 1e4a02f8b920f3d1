"""Every experiment by name, in the order `knnper experiment --help` lists them."""

from __future__ import annotations

from experiments import (
    base_model,
    capacity,
    device_experiments,
    hardware,
    heterogeneity,
    k_sigma,
    lambda_vs_n,
)
from experiments.spec import Experiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        heterogeneity.EXPERIMENT,
        capacity.EXPERIMENT,
        hardware.EXPERIMENT,
        base_model.EXPERIMENT,
        lambda_vs_n.EXPERIMENT,
        k_sigma.EXPERIMENT,
        device_experiments.SHIFT_EXPERIMENT,
        device_experiments.GRID_EXPERIMENT,
    )
}
