"""What every experiment shares inside one output folder: the scale (a RunConfig), the global
models trained for it (DIR/runs, one per configuration, reused by every experiment that asks for
the same one), their client embeddings, and each experiment's store of finished points."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edge_runtime.personal_head import ClientSplits
from experiments.points import PointStore
from experiments.spec import format_alpha
from experiments.table_seeds import seed_dir
from fed_train.algorithms.base import TrainingConfig
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.knn_setting import KNNChoice
from fed_train.knn_tuning import client_views
from fed_train.run import MODEL_FILE, LoadedRun, RunConfig, load_run, train

log = logging.getLogger(__name__)

# `--quick`: digits at a size where every experiment runs in seconds (a pipeline check).
QUICK = RunConfig(
    dataset="digits",
    partition="dirichlet",
    alpha=0.3,
    clients=8,
    unseen_fraction=0.25,
    val_fraction=0.25,
    checkpoint_every=1,
    training=TrainingConfig(rounds=3, epochs=1, batch_size=16, lr=0.05, momentum=0.9),
)


def config_id(config: RunConfig) -> str:
    """A folder name for a run: readable prefix plus a hash of the whole configuration."""
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()
    return f"{config.dataset}-{config.partition}-a{format_alpha(config.alpha)}-{digest[:10]}"


@dataclass
class Context:
    out: Path
    config: RunConfig  # the scale; experiments vary alpha (and nothing else) per point
    knn: KNNRequest = field(default_factory=KNNRequest)
    quick: bool = False
    progress: bool = True
    points_done: Callable[[bool], None] = lambda computed: None  # see PointStore.on_point
    device: str = "cpu"
    client_batch: int = 1
    seed_folders: bool = False  # one of several seeds (`--seeds`): its own files in seed_S/
    _runs: dict[str, LoadedRun] = field(default_factory=dict)
    _views: dict[str, list[ClientSplits]] = field(default_factory=dict)
    _choices: dict[str, KNNChoice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The experiments' kNN pipeline defaults to the paper's: the kNN interpolated with the
        # global model, lambda from each client's own evidence (what their claims are about);
        # --base and --lambda-rule run them with the project's other settings.
        self.knn = replace(
            self.knn, base=self.knn.base or "global", lambda_rule=self.knn.lambda_rule or "client"
        )

    @property
    def seed(self) -> int:
        return self.config.seed

    def config_for(self, alpha: float | None = None) -> RunConfig:
        return self.config if alpha is None else replace(self.config, alpha=float(alpha))

    def run_dir(self, alpha: float | None = None) -> Path:
        return self.out / "runs" / config_id(self.config_for(alpha))

    def run(self, alpha: float | None = None) -> LoadedRun:
        """FedAvg's global model for this scale and alpha, trained (or resumed) on first use."""
        config = self.config_for(alpha)
        name = config_id(config)
        if name not in self._runs:
            path = self.out / "runs" / name
            if not (path / MODEL_FILE).is_file():
                log.info("training the global model %s", path)
                train(
                    config,
                    path,
                    progress=self.progress,
                    device=self.device,
                    client_batch=self.client_batch,
                )
            self._runs[name] = load_run(path, self.device)
        return self._runs[name]

    def knn_choice(self, alpha: float | None = None) -> KNNChoice:
        """kNN-Per's configuration for run(alpha): its saved choice, as `knnper evaluate` and
        `knnper export` run it (fed_train.knn_choice), made on first use."""
        name = config_id(self.config_for(alpha))
        if name not in self._choices:
            run = self.run(alpha)
            self._choices[name] = load_or_choose(
                run.run_dir, run.model, run.clients(), self.knn, seed=self.seed
            )
        return self._choices[name]

    @property
    def k(self) -> int:
        """The base run's chosen k (where an experiment does not sweep it)."""
        return self.knn_choice().config.k

    @property
    def sigma(self) -> float:
        return self.knn_choice().config.sigma

    def views(self, alpha: float | None = None) -> list[ClientSplits]:
        """Every client's embeddings under the final global model of run(alpha), normalised as
        that run's kNN-Per configuration says."""
        name = config_id(self.config_for(alpha))
        if name not in self._views:
            run = self.run(alpha)
            self._views[name] = client_views(
                run.model, run.clients(), normalize=self.knn_choice(alpha).config.normalize
            )
        return self._views[name]

    def num_classes(self, alpha: float | None = None) -> int:
        return int(self.run(alpha).dataset.num_classes)

    def point_key(self, alpha: float | None = None, **values: Any) -> dict[str, Any]:
        """What a point depends on: the run's configuration (by its id), what was asked of
        kNN-Per's configuration (its choice follows from the run), the values."""
        return {"run": config_id(self.config_for(alpha)), "knn": self.knn.key(), **values}

    def folder(self, experiment: str) -> Path:
        """Where this seed's own files of an experiment go: OUT/NAME, or OUT/NAME/seed_S when
        several seeds run into the same OUT/NAME."""
        base = self.out / experiment
        return seed_dir(base, self.seed) if self.seed_folders else base

    def points(self, experiment: str) -> PointStore:
        return PointStore(self.out / experiment / "points.jsonl", self.points_done)

    def figure_scale(self, seeds: Sequence[int] = ()) -> str:
        """The data set and scale in a short line, for a figure's title."""
        c, t = self.config, self.config.training
        data = c.dataset + (f" ({c.max_train} train images)" if c.max_train else "")
        seed = f"{len(seeds)} seeds" if len(seeds) > 1 else f"seed {c.seed}"
        return (
            f"{data}, {c.partition} partition, {c.clients} clients, FedAvg {t.rounds} "
            f"rounds, {seed}" + (" (--quick)" if self.quick else "")
        )

    def scale_line(self, seeds: Sequence[int] = ()) -> str:
        """The scale in a sentence; `seeds`: those of a multi-seed run (kNN-Per's configuration
        named is then the first seed's)."""
        c, t = self.config, self.config.training
        seed = (
            f"{len(seeds)} seeds ({', '.join(map(str, seeds))})"
            if len(seeds) > 1
            else f"seed {c.seed}"
        )
        data = c.dataset + (f" (max {c.max_train} train images)" if c.max_train else "")
        return (
            f"{data}, {c.partition} partition, {c.clients} clients "
            f"({c.unseen_fraction:.0%} unseen, validation {c.val_fraction:.0%} of each "
            f"train split), model {c.model or 'default for the input'}, FedAvg {t.rounds} "
            f"rounds x {t.epochs} local epoch(s), batch {t.batch_size}, lr {t.lr:g} "
            f"(momentum {t.momentum:g}), participation {t.participation:g}, {seed}; "
            f"{self.knn_choice().describe()} unless swept; lambda chosen per client from "
            "{0, .1, .3, .5, .7, .9, 1}"
        )
