"""The one budget value: the room a datastore gets is the total less the encoder, and its samples'
the room less a refitted head's file, wherever it is asked for (exporter, sizer, device init, the
runtime's fit check, upgrade)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_runtime.budget import Budget


def test_room_is_what_the_encoder_leaves_and_may_be_negative():
    assert Budget(10_000, 3_000).room == 7_000
    assert Budget(2_000, 3_000).room == -1_000  # the callers refuse it, each in its own words


def test_the_encoder_share_is_added_once_it_is_known():
    budget = Budget(10_000)  # as a profile makes it, before the encoder is built
    with pytest.raises(ValueError, match="its encoder's share is not known"):
        _ = budget.room
    assert budget.with_encoder(3_000) == Budget(10_000, 3_000)
    assert budget.with_encoder(3_000).with_encoder(4_000).room == 6_000  # a client's own encoder


def test_numpy_integers_become_python_ints():
    budget = Budget(np.int64(1_000), np.int32(10))
    assert type(budget.total) is int and type(budget.encoder) is int


@pytest.mark.parametrize("total", [0, -5, 1.5, 1e6, True, "100"])
def test_a_total_must_be_a_positive_whole_number_of_bytes(total):
    with pytest.raises(ValueError, match="budget_bytes must be a positive integer"):
        Budget(total, 0)


def test_an_encoder_share_must_be_a_count():
    with pytest.raises(ValueError, match="non-negative integer"):
        Budget(1_000, -1)
    with pytest.raises(ValueError, match="head file's bytes must be a non-negative integer"):
        Budget(1_000, 10).with_head(-1)


def test_the_samples_room_is_what_a_refitted_heads_file_leaves_of_the_room():
    """The head's file was subtracted by hand in four places (the sizer, add, upgrade and the
    refusal's arithmetic); now a budget carries it."""
    budget = Budget(10_000, 3_000).with_head(1_200)
    assert (budget.room, budget.sample_room) == (7_000, 5_800)
    assert Budget(10_000, 3_000).sample_room == 7_000  # no head refitted
