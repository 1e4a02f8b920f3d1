"""The linear personal head's regularisation, chosen as kNN-Per's k and sigma are: once per run,
on the pooled validation splits of the clients seen in training, never on test.

Each client fits one head per grid value on its train embeddings and reports only per-value
sums over its validation split (samples right, summed log-loss, samples); `pick_config` pools
them and ranks by `choice_key`, so a federated evaluation could make the same choice from the
same sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from edge_runtime.knn import split_score
from edge_runtime.linear_head import L2_GRID, LinearHead
from fed_train.knn_tuning import ClientView, choosing_views, pick_config


@dataclass(frozen=True)
class LinearConfig:
    """One point of the linear head's grid."""

    l2: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def l2_counts(view: ClientView, grid: Sequence[float] = L2_GRID) -> np.ndarray:
    """One client's share of the choice, [grid, 3]: for a head fitted on its train split with
    each l2, validation samples right, summed log-loss and samples."""
    out = np.zeros((len(grid), 3))
    n = len(view.y_val)
    for i, l2 in enumerate(grid):
        head = LinearHead(view.num_classes, l2=l2).fit(view.z_train, view.y_train)
        accuracy, nll = split_score(head.predict_proba(view.z_val), view.y_val)
        out[i] = (round(accuracy * n), nll * n, n)
    return out


def choose_l2(views: Sequence[ClientView],
              grid: Sequence[float] = L2_GRID) -> tuple[float, dict[str, Any]]:
    """The l2 whose heads score best on the seen clients' pooled validation splits (ties: the
    stronger regularisation, first in the grid), and the record of the choice: every grid
    value's scores and which clients and samples it was made on."""
    seen = choosing_views(views)
    config, scores = pick_config([LinearConfig(float(l2)) for l2 in grid],
                                 [l2_counts(v, grid) for v in seen])
    return config.l2, {"config": config.to_dict(), "grid": scores,
                       "chosen_on": {"splits": "validation splits of the seen clients, pooled",
                                     "clients": [v.client_id for v in seen],
                                     "samples": int(sum(len(v.y_val) for v in seen))}}
