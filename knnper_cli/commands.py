"""The `knnper` commands by name: the module that declares each (its flags and what it runs)
and its line in `knnper --help`. `knnper --help`, `--version` and a mistyped command are
answered from this table alone, before any command module is imported; then only the module of
the command named is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommandEntry:
    """Where a command is declared: `module`'s function `adder(subparsers)` adds it (with the
    other commands of its group), and `help` is its line in `knnper --help`."""

    module: str
    adder: str
    help: str


_TRAIN = ("knnper_cli.train", "add_train_commands")

COMMANDS: dict[str, CommandEntry] = {
    "train": CommandEntry(*_TRAIN, "train FedAvg's global model on a partitioned data set"),
    "evaluate": CommandEntry(*_TRAIN, "local / FedAvg / kNN-Per accuracy of a finished run"),
    "client-data": CommandEntry(
        *_TRAIN,
        "write one client's raw data as the .npz / .npy files the device commands "
        "(knnper-edge) take",
    ),
    "pretrain": CommandEntry(
        *_TRAIN,
        "train the model centrally on a server-held split that no client sees, as the "
        "starting point for --init",
    ),
    "bench": CommandEntry(
        "knnper_cli.bench", "add_bench_command", "benchmarks: the paper's comparison tables"
    ),
    "export": CommandEntry(
        "knnper_cli.export",
        "add_export_command",
        "write per-device bundles (int8 ONNX encoder + datastore sized to each device's "
        "budget) from a finished run",
    ),
    "demo": CommandEntry(
        "knnper_cli.demo",
        "add_demo_command",
        "the whole pipeline on scikit-learn's digits in about a minute: train, evaluate, "
        "export for weak and strong devices, run them",
    ),
    "experiment": CommandEntry(
        "knnper_cli.experiment",
        "add_experiment_command",
        "the paper's experiments, one command each: CSV, PNG plot and a summary with the "
        "paper's claims",
    ),
    "deploy": CommandEntry(
        "knnper_cli.deploy",
        "add_deploy_command",
        "federated training on Flower (SuperLink + SuperNodes)",
    ),
}


def help_of(name: str) -> str:
    """The command's line in `knnper --help` (its module declares it with this help)."""
    return COMMANDS[name].help
