"""What a SuperNode's ClientApp process pays per message: the module loads without torch (the
query and every handler import what they need), and a client's splits are read once per run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from flwr.app import RecordDict

from fed_train.flower.client_data import DATA_KEY, load_node_client
from fed_train.run import RunConfig, load_run_data

REPO = Path(__file__).resolve().parents[1]


def test_clientapp_module_loads_without_torch():
    code = "import sys, fed_train.flower.client_app; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "False"


def test_client_splits_are_read_once_per_run_and_kept_on_the_node():
    config = RunConfig(dataset="digits", clients=4)
    dataset, _ = load_run_data(config)
    store = RecordDict()
    first = load_node_client(
        config, {"partition-id": 2}, dataset.input_spec, dataset.num_classes, store
    )
    assert DATA_KEY in store
    # a later message reads the node's copy: a data set that is not there is never opened
    gone = RunConfig(dataset="npz", data="/nonexistent/data.npz", clients=4)
    again = load_node_client(
        gone, {"partition-id": 2}, dataset.input_spec, dataset.num_classes, store
    )
    for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(first, name), getattr(again, name))
    assert again.client_id == 2 and again.num_train > 0
