"""Each personalized-FL baseline's defining step, on tiny synthetic federations (seconds)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fed_train.algorithms import ALGORITHMS, build_algorithm
from fed_train.algorithms.apfl import APFL
from fed_train.algorithms.base import ClientData, TrainingConfig
from fed_train.algorithms.clustered import ClusteredFL, ClusterState
from fed_train.algorithms.ditto import Ditto
from fed_train.algorithms.fedavg import FedAvg
from fed_train.algorithms.fedavg_plus import FedAvgPlus
from fed_train.algorithms.fedrep import FedRep
from fed_train.algorithms.personal import accuracy
from fed_train.algorithms.pfedgp import PFedGP, gp_logits, gp_posterior
from fed_train.simulation import load_checkpoint, save_checkpoint
from tests.helpers.federation import TRAINING, initial_weights, make_clients, model_fn, train


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)


def test_every_baseline_is_registered_and_unknown_names_are_refused():
    for name in ("fedavg+", "clustered", "ditto", "fedrep", "apfl", "pfedgp"):
        assert ALGORITHMS[name].name == name
    with pytest.raises(ValueError, match="unknown method 'fedsgd'"):
        build_algorithm("fedsgd", model_fn, TRAINING)


# FedAvg+ ---------------------------------------------------------------------------------------


def test_fedavg_plus_with_zero_finetune_epochs_is_fedavg():
    clients = make_clients()
    weights = train(FedAvg(model_fn, TRAINING), clients).weights
    plain = FedAvg(model_fn, TRAINING).personalize(weights, clients[0], {}, 0)
    tuned = FedAvgPlus(model_fn, TRAINING, finetune_epochs=0).personalize(
        weights, clients[0], {}, 0
    )
    x = clients[0].x_test
    np.testing.assert_array_equal(tuned.predict_proba(x), plain.predict_proba(x))
    assert tuned.info == {"finetune_epochs": 0}


def test_fedavg_plus_finetuning_adapts_a_client_the_global_model_gets_wrong():
    clients = make_clients(swapped=(5,), unseen=(5,))
    weights = train(FedAvg(model_fn, TRAINING), clients).weights
    outsider = clients[5]
    plain = FedAvg(model_fn, TRAINING).personalize(weights, outsider, {}, 0)
    tuned = FedAvgPlus(model_fn, TRAINING, finetune_epochs=5).personalize(weights, outsider, {}, 0)
    before = accuracy(plain.predict_proba(outsider.x_test), outsider.y_test)
    after = accuracy(tuned.predict_proba(outsider.x_test), outsider.y_test)
    assert tuned.info["finetune_epochs"] > 0
    assert after > before + 0.3


# Ditto -----------------------------------------------------------------------------------------


def test_ditto_global_model_is_fedavg():
    clients = make_clients()
    fedavg = train(FedAvg(model_fn, TRAINING), clients)
    ditto = train(Ditto(model_fn, TRAINING, lambdas=(1.0,)), clients)
    assert_same_weights(ditto.weights, fedavg.weights)
    assert set(ditto.states[0]["personal"]) == {"1.0"}


def test_ditto_with_infinite_lambda_keeps_the_personal_model_at_the_global_one():
    clients = make_clients()
    w = initial_weights()
    for lam in (math.inf, 1e12):
        result = Ditto(model_fn, TRAINING, lambdas=(lam,)).client_update(w, clients[0], {}, 0.1, 7)
        assert_same_weights(result.state["personal"][str(lam)], w, atol=1e-6)
    free = Ditto(model_fn, TRAINING, lambdas=(0.0,)).client_update(w, clients[0], {}, 0.1, 7)
    assert not np.allclose(
        free.state["personal"]["0.0"]["classifier.weight"], w["classifier.weight"]
    )


def test_ditto_client_with_other_labels_picks_a_weak_pull_to_the_global_model():
    clients = make_clients(swapped=(0,))
    algorithm = Ditto(model_fn, TRAINING, lambdas=(1e6, 0.0))
    sim = train(algorithm, clients)
    odd = algorithm.personalize(sim.weights, clients[0], sim.states[0], 0)
    usual = algorithm.personalize(sim.weights, clients[1], sim.states[1], 0)
    assert odd.info["lambda"] == 0.0
    assert accuracy(odd.predict_proba(clients[0].x_test), clients[0].y_test) > 0.7
    assert usual.info["lambda"] == 1e6  # ties and near-ties keep the global model


# FedRep ----------------------------------------------------------------------------------------


def test_fedrep_shares_the_body_and_keeps_heads_personal():
    clients = make_clients(swapped=(0, 1))
    algorithm = FedRep(model_fn, TRAINING, head_epochs=2)
    w0 = initial_weights()
    result = algorithm.client_update(w0, clients[0], {}, 0.1, 3)
    assert set(result.weights) == {"body.0.weight", "body.0.bias"}  # heads never leave a client
    sim = train(algorithm, clients)
    np.testing.assert_array_equal(sim.weights["classifier.weight"], w0["classifier.weight"])
    assert not np.allclose(sim.weights["body.0.weight"], w0["body.0.weight"])
    heads = [sim.states[c]["head"]["classifier.weight"] for c in range(4)]
    assert not np.allclose(heads[0], heads[2])  # swapped and usual clients: different heads

    # personalization = the shared global body + the client's own head (no refresh epochs here)
    frozen = FedRep(model_fn, TRAINING, head_epochs=0)
    for c in (0, 2):
        manual = model_fn()
        manual.load_state_dict(
            {k: torch.from_numpy(v) for k, v in {**sim.weights, **sim.states[c]["head"]}.items()}
        )
        manual.eval()
        with torch.no_grad():
            expected = torch.softmax(manual(clients[c].x_test), 1).double().numpy()
        got = frozen.personalize(sim.weights, clients[c], sim.states[c], 0)
        np.testing.assert_allclose(got.predict_proba(clients[c].x_test), expected, atol=1e-6)


def test_fedrep_unseen_client_trains_a_head_on_the_frozen_body():
    clients = make_clients(swapped=(5,), unseen=(5,))
    algorithm = FedRep(model_fn, TRAINING, head_epochs=2, unseen_head_epochs=20)
    sim = train(algorithm, clients)
    personal = algorithm.personalize(sim.weights, clients[5], {}, 0)
    assert personal.info == {"head_epochs": 20}
    assert accuracy(personal.predict_proba(clients[5].x_test), clients[5].y_test) > 0.7


# APFL ------------------------------------------------------------------------------------------


def test_apfl_with_alpha_zero_is_fedavg():
    clients = make_clients()
    fedavg = train(FedAvg(model_fn, TRAINING), clients)
    apfl = train(APFL(model_fn, TRAINING, alphas=(0.0,)), clients)
    assert_same_weights(apfl.weights, fedavg.weights)
    plain = FedAvg(model_fn, TRAINING).personalize(fedavg.weights, clients[0], {}, 0)
    mixed = APFL(model_fn, TRAINING, alphas=(0.0,)).personalize(
        apfl.weights, clients[0], apfl.states[0], 0
    )
    np.testing.assert_allclose(
        mixed.predict_proba(clients[0].x_test), plain.predict_proba(clients[0].x_test), atol=1e-6
    )


def test_apfl_personal_mixture_fits_a_client_with_other_labels():
    clients = make_clients(swapped=(0,))
    algorithm = APFL(model_fn, TRAINING)
    sim = train(
        algorithm, clients, TrainingConfig(rounds=4, epochs=2, batch_size=16, lr=0.1, milestones=())
    )
    assert set(sim.states[0]["personal"]) == {"0.1", "0.3", "0.5", "0.7", "0.9"}
    odd = algorithm.personalize(sim.weights, clients[0], sim.states[0], 0)
    assert odd.info["alpha"] >= 0.5
    assert accuracy(odd.predict_proba(clients[0].x_test), clients[0].y_test) > 0.7


# ClusteredFL -----------------------------------------------------------------------------------


def test_clustered_fl_separates_clients_whose_labels_are_swapped():
    clients = make_clients(count=7, swapped=(3, 4, 5, 6), unseen=(6,))
    # tolerances that let one split happen, in the last round: it is the bi-partition by
    # cosine similarity of the updates that must find the two groups
    algorithm = ClusteredFL(model_fn, TRAINING, eps1=1e6, eps2=0.0, warmup_rounds=2)
    sim = train(algorithm, clients)
    server = ClusterState.unpack(sim.weights)
    assert len(server.models) >= 2
    groups = {cid: server.cluster_of(cid) for cid in range(6)}
    assert groups[0] == groups[1] == groups[2]
    assert groups[3] == groups[4] == groups[5] != groups[0]
    seen = algorithm.personalize(sim.weights, clients[3], {}, 0)
    assert seen.info["cluster"] == groups[3] and not seen.info["picked_on_validation"]
    new = algorithm.personalize(sim.weights, clients[6], {}, 0)
    assert new.info["picked_on_validation"] and new.info["cluster"] == groups[3]


def test_clustered_fl_does_not_split_while_updates_are_small():
    clients = make_clients(swapped=(3, 4, 5))
    sim = train(ClusteredFL(model_fn, TRAINING, eps1=1e6, eps2=1e6, warmup_rounds=0), clients)
    assert len(ClusterState.unpack(sim.weights).models) == 1


def test_clustered_fl_server_state_survives_a_checkpoint(tmp_path):
    clients = make_clients(swapped=(3, 4, 5))
    sim = train(ClusteredFL(model_fn, TRAINING, eps1=1e6, eps2=0.0, warmup_rounds=2), clients)
    save_checkpoint(tmp_path / "round_0003.pt", 3, sim.weights, sim.states)
    back = ClusterState.unpack(load_checkpoint(tmp_path / "round_0003.pt").weights)
    before = ClusterState.unpack(sim.weights)
    assert back.members == before.members and back.round == before.round == 3
    for a, b in zip(back.models, before.models, strict=True):
        assert_same_weights(a, b)


def test_clustered_fl_refuses_a_result_whose_state_it_did_not_send():
    """What a remote client's reply says of its id and cluster is checked before the server
    aggregates it: its own id, a cluster that exists, and the one it was placed in."""
    clients = make_clients(swapped=(3, 4, 5))
    algorithm = ClusteredFL(model_fn, TRAINING, eps1=1e6, eps2=0.0, warmup_rounds=2)
    sim = train(algorithm, clients)
    server = ClusterState.unpack(sim.weights)
    assert len(server.models) >= 2  # client 0 is placed in a cluster; others exist
    honest = algorithm.client_update(sim.weights, clients[0], {}, 0.01, 0)
    algorithm.check_result(sim.weights, 0, honest)  # what client_update sends passes
    placed = server.cluster_of(0)
    other = next(c for c in range(len(server.models)) if c != placed)
    for state, why in (
        ({"client_id": 1, "cluster": placed}, "names client 1, not 0"),
        ({"client_id": True, "cluster": placed}, "names client True"),
        ({"cluster": placed}, "names client None"),
        ({"client_id": 0, "cluster": len(server.models)}, "is not one of"),
        ({"client_id": 0, "cluster": -1}, "is not one of"),
        ({"client_id": 0, "cluster": "0"}, "is not one of"),
        ({"client_id": 0, "cluster": other}, f"server placed it in {placed}"),
    ):
        with pytest.raises(ValueError, match=why):
            algorithm.check_result(sim.weights, 0, replace(honest, state=state))
    # a client new to the server (no placement yet) may pick any existing cluster
    algorithm.check_result(
        sim.weights, 99, replace(honest, state={"client_id": 99, "cluster": other})
    )


# pFedGP ----------------------------------------------------------------------------------------


def test_gp_posterior_on_two_separated_clusters():
    rng = np.random.default_rng(0)
    a = torch.tensor([1.0, 0.0]) + 0.05 * torch.tensor(rng.normal(size=(10, 2)))
    b = torch.tensor([0.0, 1.0]) + 0.05 * torch.tensor(rng.normal(size=(10, 2)))
    z = torch.cat([a, b]).double()
    y = torch.tensor([0] * 10 + [1] * 10)
    queries = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7071, 0.7071], [-1.0, -1.0]]).double()
    mean, var = gp_posterior(z, y, queries, 2, lengthscale=0.5)
    p = torch.softmax(gp_logits(mean, var), 1).numpy()
    assert p[0, 0] > 0.9 and p[1, 1] > 0.9
    assert abs(p[2, 0] - p[2, 1]) < 0.05  # equidistant: no preference
    # far from all data the prediction falls back to the prior (balanced here) and is uncertain
    assert abs(p[3, 0] - p[3, 1]) < 0.05
    assert var[3, 0] > 10 * var[0, 0]


def test_pfedgp_trains_the_shared_kernel_and_classifies_with_each_clients_gp():
    clients = make_clients(swapped=(0,), unseen=(5,))
    algorithm = PFedGP(model_fn, TRAINING)
    w0 = initial_weights()
    sim = train(algorithm, clients)
    np.testing.assert_array_equal(sim.weights["classifier.weight"], w0["classifier.weight"])
    assert not np.allclose(sim.weights["body.0.weight"], w0["body.0.weight"])
    for c in (0, 5):  # a client with other labels and an unseen one: both from their own data
        personal = algorithm.personalize(sim.weights, clients[c], {}, 0)
        proba = personal.predict_proba(clients[c].x_test)
        np.testing.assert_allclose(proba.sum(1), 1.0, atol=1e-9)
        assert accuracy(proba, clients[c].y_test) > 0.8
    # pFedGP's label map: a client that never saw classes 2 and 3 never predicts them
    two = clients[1]
    keep = two.y_train < 2
    two = ClientData(
        1, two.x_train[keep], two.y_train[keep], two.x_val, two.y_val, two.x_test, two.y_test
    )
    personal = algorithm.personalize(sim.weights, two, {}, 0)
    assert personal.info["classes"] == 2
    assert personal.predict_proba(two.x_test)[:, 2:].max() == 0.0


# bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Ditto(model_fn, TRAINING, lambdas=(1.0, -0.1)), "lambda must be >= 0"),
        (lambda: Ditto(model_fn, TRAINING, lambdas=()), "at least one"),
        (lambda: APFL(model_fn, TRAINING, alphas=(0.5, 1.5)), r"alpha must be in \[0, 1\]"),
        (lambda: FedAvgPlus(model_fn, TRAINING, finetune_epochs=-1), "finetune_epochs"),
        (lambda: FedRep(model_fn, TRAINING, head_epochs=-2), "head_epochs"),
        (lambda: ClusteredFL(model_fn, TRAINING, eps1=-1.0), "eps1"),
        (lambda: ClusteredFL(model_fn, TRAINING, warmup_rounds=-1), "warmup_rounds"),
        (lambda: PFedGP(model_fn, TRAINING, predict_ratio=1.0), "predict_ratio"),
    ],
)
def test_bad_hyper_parameters_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("update_global", [True, False])
def test_apfl_divergence_in_the_global_or_a_personal_model_stops_the_round(update_global):
    """Losses are checked once after the local steps (no wait on the device per step), and a
    NaN in any of the models still raises."""
    from fed_train.errors import TrainingDiverged

    weights = {
        k: np.full_like(v, np.nan) if k.endswith("bias") else v
        for k, v in initial_weights().items()
    }
    apfl = APFL(model_fn, TRAINING, alphas=(0.5,))
    client = make_clients(1)[0]
    with pytest.raises(TrainingDiverged, match="lower the learning rate"):
        if update_global:
            apfl.client_update(weights, client, {}, 0.1, 0)
        else:
            apfl.client_update(initial_weights(), client, {"personal": {"0.5": weights}}, 0.1, 0)
