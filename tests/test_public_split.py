"""The fair tables' data split: the server's public part and the clients' part share no training
image, keep the label shares, and a split that would leave either side empty is refused."""

from __future__ import annotations

import numpy as np
import pytest

from fed_train.data import load_dataset
from fed_train.errors import DataError
from fed_train.public_split import split_public


def test_the_server_and_the_clients_share_no_training_image(tmp_path):
    full = load_dataset("digits", seed=0)
    server, clients = (np.load(p) for p in split_public("digits", None, 500, 100, 0, tmp_path))
    assert (len(clients["y_train"]), len(clients["y_test"]), len(server["y_test"])) == (500, 100, 0)
    assert len(server["y_train"]) + 500 == len(full.y_train)
    rows = {x.tobytes() for x in server["x_train"]}
    assert not any(x.tobytes() in rows for x in clients["x_train"])
    shares = np.bincount(clients["y_train"], minlength=10) / 500
    assert np.abs(shares - np.bincount(full.y_train, minlength=10) / len(full.y_train)).max() < 0.01


@pytest.mark.parametrize("client_train", [0, 10**6])
def test_a_split_leaving_a_side_empty_is_refused(tmp_path, client_train):
    with pytest.raises(DataError, match="client_train must be in"):
        split_public("digits", None, client_train, None, 0, tmp_path)
    assert not list(tmp_path.iterdir())
