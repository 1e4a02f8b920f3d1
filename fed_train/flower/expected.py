"""What a `deploy local` run of a given size can be expected to reach, so that a short first run
(FedAvg at 38% after 5 rounds on digits) does not look broken: accuracies measured with the
in-process simulation, which reaches Flower's weights bit for bit, at a few sizes of the default
settings (benchmarks/flower_expected.py writes expected.json beside this module)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from edge_runtime._io import read_json
from fed_train.run import RunConfig

EXPECTED_FILE = Path(__file__).with_name("expected.json")
MEASURED = ("fedavg", "knnper")
_SIZE_KEYS = ("clients", "data", "checkpoint_every")  # what may differ from a measured run


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration less its size (clients, rounds) and where its data lies."""
    kept = {k: v for k, v in config.items() if k not in _SIZE_KEYS}
    kept["training"] = {k: v for k, v in config["training"].items() if k != "rounds"}
    return json.loads(json.dumps(kept))  # tuples as lists, as read back from JSON


def nearest_measured(config: RunConfig, path: Path = EXPECTED_FILE) -> dict[str, Any] | None:
    """The measured run with the same settings whose clients and rounds are nearest (by
    ratio), or None when no run with these settings was measured."""
    try:
        runs = read_json(path, limit=1 << 20, fix="restore it from the package")["runs"]
    except FileNotFoundError:
        return None
    want = _settings(config.to_dict())
    same = [r for r in runs if _settings(r["config"]) == want]
    if not same:
        return None

    def distance(run: dict[str, Any]) -> float:
        c = run["config"]
        return abs(math.log(c["clients"] / config.clients)) + abs(
            math.log(c["training"]["rounds"] / config.training.rounds)
        )

    return min(same, key=distance)


def expectation_line(config: RunConfig, path: Path = EXPECTED_FILE) -> str:
    """One line for the user: the nearest measured size and its accuracies, or why none."""
    run = nearest_measured(config, path)
    if run is None:
        return (
            "expected: no run with these settings was measured; `knnper train` with the "
            "same flags reaches the same weights in a fraction of the time"
        )
    c = run["config"]
    size = f"{c['dataset']}, {c['clients']} clients, {c['training']['rounds']} rounds"
    exact = c["clients"] == config.clients and c["training"]["rounds"] == config.training.rounds
    scores = ", ".join(
        f"{name} {run[f'{m}_seen']}% seen / {run[f'{m}_unseen']}% unseen"
        for m, name in (("fedavg", "FedAvg"), ("knnper", "kNN-Per"))
        if f"{m}_seen" in run and f"{m}_unseen" in run
    )
    return (
        f"expected ({'this size' if exact else 'nearest measured size'}: {size}): "
        f"{scores} (the simulation, same weights as Flower; {run.get('source', path.name)})"
    )
