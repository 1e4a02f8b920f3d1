"""Pretraining on a server-held split and `--init`: the files it writes, a server split that no
client ever holds, the same starting weights in train and bench, and hostile or mismatched
weight files refused on one line (exit 2) before anything is written."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.tables import TableOptions, TableRunner
from fed_train import run as run_module
from fed_train.algorithms.base import TrainingConfig, predict_proba
from fed_train.data import load_dataset
from fed_train.run import RunConfig, load_run
from knnper_cli.main import main

# 30% of digits' 1347 training images: enough for a body that beats one round from scratch
PRETRAIN = [
    "--no-progress",
    "pretrain",
    "--dataset",
    "digits",
    "--server-fraction",
    "0.3",
    "--epochs",
    "15",
    "--seed",
    "0",
]
RUN = [
    "--dataset",
    "digits",
    "--clients",
    "10",
    "--rounds",
    "1",
    "--batch-size",
    "16",
    "--lr",
    "0.02",
    "--momentum",
    "0.9",
    "--seed",
    "0",
]


def _train(out: Path, *extra: str) -> int:
    return main(["--no-progress", "train", *RUN, "--out", str(out), *extra])


def _config(init: str | None) -> RunConfig:
    return RunConfig(
        clients=10,
        seed=0,
        init=init,
        training=TrainingConfig(rounds=1, batch_size=16, lr=0.02, momentum=0.9),
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrain") / "digits"
    assert main([*PRETRAIN, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def init_run(tmp_path_factory, pretrained) -> Path:
    out = tmp_path_factory.mktemp("runs") / "init"
    assert _train(out, "--init", str(pretrained)) == 0
    return out


def test_pretrain_writes_weights_record_and_server_indices(pretrained):
    record = json.loads((pretrained / "pretrain.json").read_text())
    full = load_dataset("digits", seed=0)
    server = np.load(pretrained / "server_indices.npy", allow_pickle=False)
    assert record["dataset"] == "digits" and record["model"] == "small-cnn"
    assert record["seed"] == 0 and record["server_fraction"] == 0.3
    assert record["train_size"] == len(full.y_train)
    assert len(server) == record["server_samples"] == round(0.3 * len(full.y_train))
    assert record["samples"]["train"] + record["samples"]["val"] == len(server)
    assert 1 <= record["best_epoch"] <= record["epochs_run"] <= 15
    assert record["val_accuracy"] == max(h["val_accuracy"] for h in record["history"])
    assert np.array_equal(server, np.unique(server)) and server.max() < len(full.y_train)
    # stratified: every class keeps its share of the training set, to within one sample
    share = np.bincount(full.y_train[server], minlength=10) / len(server)
    assert np.allclose(
        share, np.bincount(full.y_train, minlength=10) / len(full.y_train), atol=1.5 / len(server)
    )
    state = torch.load(pretrained / "model.pt", weights_only=True)
    assert "classifier.weight" in state


def test_server_split_is_disjoint_from_every_clients_data(pretrained, init_run):
    server = np.load(pretrained / "server_indices.npy", allow_pickle=False)
    full = load_dataset("digits", seed=0)
    run = load_run(init_run)  # what evaluate and export see
    kept = np.setdiff1d(np.arange(len(full.y_train)), server)
    # the run's training set is the full one less the server split, sample for sample
    np.testing.assert_array_equal(run.dataset.x_train, full.x_train[kept])
    np.testing.assert_array_equal(run.dataset.y_train, full.y_train[kept])
    held = []
    for split in run.partition.clients:
        for part in (split.train, split.val):
            original = kept[part]  # back to indices of the full training set
            assert not np.intersect1d(original, server).size
            held.append(original)
    # every training sample is a client's or the server's, never both
    assert np.array_equal(np.sort(np.concatenate([*held, server])), np.arange(len(full.y_train)))
    # test data is a separate array the server split does not index, and is left whole
    np.testing.assert_array_equal(run.dataset.x_test, full.x_test)
    np.testing.assert_array_equal(run.dataset.y_test, full.y_test)
    # and by content (digits holds no duplicate images): no server image reaches any client
    server_images = {x.tobytes() for x in full.x_train[server]}
    for split in run.partition.clients:
        for images in (
            run.dataset.x_train[split.train],
            run.dataset.x_train[split.val],
            run.dataset.x_test[split.test],
        ):
            assert not server_images & {x.tobytes() for x in images}


def test_train_bench_and_evaluate_see_the_same_clients(pretrained, init_run, tmp_path):
    run = load_run(init_run)
    table = TableRunner(_config(str(pretrained)), tmp_path / "table", TableOptions(progress=False))
    np.testing.assert_array_equal(table.dataset.x_train, run.dataset.x_train)
    for a, b in zip(table.partition.clients, run.partition.clients, strict=True):
        for part in ("train", "val", "test"):
            np.testing.assert_array_equal(getattr(a, part), getattr(b, part))
    assert main(["--no-progress", "evaluate", str(init_run), "--methods", "fedavg"]) == 0


def test_init_loads_the_pretrained_weights_into_train_and_bench(pretrained, tmp_path, monkeypatch):
    state = torch.load(pretrained / "model.pt", weights_only=True)
    seen = {}
    real = run_module.simulate

    def recording(algorithm, clients, training, initial_weights, **kwargs):
        seen["weights"] = initial_weights
        return real(algorithm, clients, training, initial_weights, **kwargs)

    monkeypatch.setattr(run_module, "simulate", recording)
    assert _train(tmp_path / "run", "--init", str(pretrained / "model.pt")) == 0
    table = TableRunner(_config(str(pretrained)), tmp_path / "table", TableOptions(progress=False))
    for weights in (seen["weights"], table.initial_weights):
        assert set(weights) == set(state)
        for key, tensor in state.items():
            np.testing.assert_array_equal(weights[key], tensor.numpy())
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["init"] == str(pretrained / "model.pt")
    assert len(config["init_sha256"]) == 64
    # a bare .pt state dict removes nothing from the clients
    assert len(load_run(tmp_path / "run").dataset.y_train) == len(load_dataset("digits").y_train)


def test_a_pretrained_init_beats_scratch_at_round_one(init_run, tmp_path):
    assert _train(tmp_path / "scratch") == 0

    def pooled_test_accuracy(path: Path) -> float:
        run = load_run(path)
        hits = total = 0
        for c in run.clients():
            hits += int((predict_proba(run.model, c.x_test).argmax(1) == c.y_test.numpy()).sum())
            total += len(c.y_test)
        return hits / total

    scratch, pretrained = pooled_test_accuracy(tmp_path / "scratch"), pooled_test_accuracy(init_run)
    assert pretrained > scratch + 0.3, (pretrained, scratch)  # measured 0.88 vs 0.19


def _state_with(pretrained: Path, change) -> dict:
    state = torch.load(pretrained / "model.pt", weights_only=True)
    change(state)
    return state


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {_MARKER}",))


_MARKER = Path("/tmp") / f"knnper-init-pickle-ran-{os.getpid()}"


def _bad_files(pretrained: Path, where: Path) -> dict[str, tuple[Path, str]]:
    """Bad --init paths and the text their one-line error must hold."""
    files = {}

    def save(name: str, obj, message: str) -> None:
        path = where / f"{name}.pt"
        torch.save(obj, path)
        files[name] = (path, message)

    save(
        "wrong_shape",
        _state_with(pretrained, lambda s: s.update({"classifier.weight": torch.zeros(5, 128)})),
        "'classifier.weight' has shape [5, 128] in the file, [10, 128] in the model",
    )
    save(
        "missing_key",
        _state_with(pretrained, lambda s: s.pop("classifier.bias")),
        "'classifier.bias' (shape [10] in the model) is missing",
    )
    save(
        "extra_key",
        _state_with(pretrained, lambda s: s.update({"extra": torch.zeros(1)})),
        "'extra' is not one of the model's",
    )
    save(
        "nan",
        _state_with(pretrained, lambda s: s["classifier.bias"].fill_(float("nan"))),
        "NaN or infinite",
    )
    save("bare_tensor", torch.zeros(3), "not a state dict (it holds a Tensor")
    save("not_tensors", {"classifier.weight": [1.0, 2.0]}, "entry 'classifier.weight' is a list")
    path = where / "code.pt"
    path.write_bytes(pickle.dumps(_RunsCode()))
    files["pickle_with_code"] = (path, "refused without running its code")
    path = where / "junk.pt"
    path.write_bytes(b"not a checkpoint at all")
    files["junk"] = (path, "is not a readable torch state dict")
    files["missing"] = (where / "nowhere.pt", "no such file or directory")

    other = where / "other-model"
    shutil.copytree(pretrained, other)
    record = json.loads((other / "pretrain.json").read_text())
    (other / "pretrain.json").write_text(json.dumps({**record, "model": "mobilenet-v2"}))
    files["other_model"] = (other, "was pretrained for dataset digits with model mobilenet-v2")
    outside = where / "indices-outside"
    shutil.copytree(pretrained, outside)
    np.save(outside / "server_indices.npy", np.array([0, 5000]))
    files["indices_outside"] = (outside, "index 5000, outside the 1347 training samples")
    objects = where / "indices-objects"
    shutil.copytree(pretrained, objects)
    np.save(objects / "server_indices.npy", np.array([1, "a"], dtype=object), allow_pickle=True)
    files["indices_pickled"] = (objects, "is not a readable .npy file")
    return files


BAD = [
    "wrong_shape",
    "missing_key",
    "extra_key",
    "nan",
    "bare_tensor",
    "not_tensors",
    "pickle_with_code",
    "junk",
    "missing",
    "other_model",
    "indices_outside",
    "indices_pickled",
]


@pytest.fixture(scope="module")
def bad_files(pretrained, tmp_path_factory):
    return _bad_files(pretrained, tmp_path_factory.mktemp("bad-init"))


@pytest.mark.parametrize("name", BAD)
def test_a_bad_init_is_refused_on_one_line_before_anything_is_written(
    name, bad_files, tmp_path, capsys
):
    path, message = bad_files[name]
    out = tmp_path / "run"
    assert _train(out, "--init", str(path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("knnper: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not out.exists()
    assert not _MARKER.exists()


def test_bench_table_refuses_a_mismatched_init(bad_files, tmp_path, capsys):
    out = tmp_path / "table"
    code = main(
        [
            "--no-progress",
            "bench",
            "table",
            *RUN,
            "--methods",
            "fedavg",
            "--out",
            str(out),
            "--init",
            str(bad_files["wrong_shape"][0]),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'classifier.weight' has shape [5, 128]" in err
    assert not out.exists()


def test_resuming_with_a_different_init_is_refused(pretrained, init_run, capsys):
    before = (init_run / "config.json").read_text()
    assert _train(init_run, "--init", str(pretrained / "model.pt")) == 2
    err = capsys.readouterr().err
    assert "was started from --init" in err and err.count("\n") == 1
    assert (init_run / "config.json").read_text() == before


def test_public_data_pretraining_removes_nothing_from_the_clients(tmp_path):
    full = load_dataset("digits", seed=1)
    public = tmp_path / "public.npz"
    np.savez(
        public,
        x_train=full.x_test,
        y_train=full.y_test,
        x_test=full.x_test[:10],
        y_test=full.y_test[:10],
    )
    out = tmp_path / "pretrain"
    assert (
        main([*PRETRAIN[:-4], "--epochs", "1", "--public-data", str(public), "--out", str(out)])
        == 0
    )
    assert np.load(out / "server_indices.npy", allow_pickle=False).size == 0
    assert json.loads((out / "pretrain.json").read_text())["public_data"] == str(public)
    assert _train(tmp_path / "run", "--init", str(out)) == 0
    assert len(load_run(tmp_path / "run").dataset.y_train) == len(full.y_train)


def test_pretrain_refuses_bad_public_data_and_an_existing_pretraining(pretrained, tmp_path, capsys):
    wrong = tmp_path / "wrong.npz"
    images = np.zeros((20, 28, 28), np.uint8)
    np.savez(
        wrong, x_train=images, y_train=np.arange(20) % 10, x_test=images, y_test=np.arange(20) % 10
    )
    assert main([*PRETRAIN, "--public-data", str(wrong), "--out", str(tmp_path / "p")]) == 2
    assert main([*PRETRAIN, "--out", str(pretrained)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "inputs of shape [28, 28, 1], but digits has [8, 8, 1]" in err[0]
    assert "already holds a pretraining" in err[1]
    assert not (tmp_path / "p").exists()


def test_a_run_whose_pretraining_changed_is_refused_on_reload(pretrained, tmp_path, capsys):
    init = tmp_path / "pretrain"
    shutil.copytree(pretrained, init)
    assert _train(tmp_path / "run", "--init", str(init)) == 0
    torch.save(_state_with(init, lambda s: s["classifier.bias"].add_(1.0)), init / "model.pt")
    assert main(["--no-progress", "evaluate", str(tmp_path / "run"), "--methods", "fedavg"]) == 2
    err = capsys.readouterr().err
    assert f"--init {init} has changed since" in err and err.count("\n") == 1


def test_augmentation_is_a_flip_and_a_shifted_crop_of_each_image():
    from fed_train.pretrain import augment_images

    x = torch.rand(16, 3, 6, 5)
    out = augment_images(x, np.random.default_rng(0), shift=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(torch.cat([x, x.flip(3)], 1), (2, 2, 2, 2))
    for image, source in zip(out, padded, strict=True):
        candidates = [
            source[c : c + 3, dy : dy + 6, dx : dx + 5]
            for c in (0, 3)
            for dy in range(5)
            for dx in range(5)
        ]
        assert any(torch.equal(image, candidate) for candidate in candidates)
    assert not torch.equal(out, x)  # 16 images: some were moved


def test_pretrain_with_augmentation_records_it(tmp_path):
    out = tmp_path / "augmented"
    assert main([*PRETRAIN[:-4], "--epochs", "1", "--augment", "--out", str(out)]) == 0
    assert json.loads((out / "pretrain.json").read_text())["augment"] is True


def test_a_weights_seed_trains_other_weights_on_the_same_server_split(tmp_path):
    """--weights-seed changes the initial weights and the batch order, never the split: runs
    from either pretraining give the clients the same samples; without it, --seed drives both
    (the default is the pretraining it always was)."""
    one_epoch = [*PRETRAIN[:-4], "--epochs", "1", "--seed", "0"]
    outs = {name: tmp_path / name for name in ("default", "same", "other")}
    assert main([*one_epoch, "--out", str(outs["default"])]) == 0
    assert main([*one_epoch, "--weights-seed", "0", "--out", str(outs["same"])]) == 0
    assert main([*one_epoch, "--weights-seed", "7", "--out", str(outs["other"])]) == 0
    records = {n: json.loads((o / "pretrain.json").read_text()) for n, o in outs.items()}
    assert [records[n]["weights_seed"] for n in outs] == [None, 0, 7]
    splits = [np.load(o / "server_indices.npy", allow_pickle=False) for o in outs.values()]
    assert all(np.array_equal(splits[0], s) for s in splits[1:])
    states = {n: torch.load(o / "model.pt", weights_only=True) for n, o in outs.items()}
    assert all(torch.equal(states["default"][k], states["same"][k]) for k in states["default"])
    assert not torch.equal(
        states["default"]["classifier.weight"], states["other"]["classifier.weight"]
    )


@pytest.mark.parametrize("value", ["-1", "x", str(2**32)])
def test_a_bad_weights_seed_is_refused_on_one_line(value, tmp_path, capsys):
    out = tmp_path / "p"
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        main([*PRETRAIN[:-4], "--epochs", "1", "--weights-seed", value, "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --weights-seed" in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("value", [-1, 1.5, True, 2**32])
def test_pretrain_refuses_a_bad_weights_seed_before_writing(value, tmp_path):
    from fed_train.pretrain import InitError, PretrainConfig, pretrain

    with pytest.raises(InitError, match="--weights-seed must be an integer"):
        pretrain(PretrainConfig(epochs=1, weights_seed=value), tmp_path / "p", progress=False)
    assert not (tmp_path / "p").exists()
