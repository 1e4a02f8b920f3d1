"""`knnper deploy`: the run as a real Flower federation (fed_train.deploy), its run config, and
its certificates."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from edge_runtime._io import is_stdout, write_output
from edge_runtime.arg_types import (
    count,
    fraction,
    output_dir,
    output_file_or_stdout,
    positive_float,
    positive_int,
)
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from edge_runtime.release import RELEASE_FILE, ReleaseError, read_release
from edge_runtime.signing import SIGNATURE_FILE, load_public_key
from fed_train.accelerator import resolve_device
from fed_train.algorithms import federated_methods
from fed_train.deploy import (
    APP_DIR,
    DeployError,
    LocalFederation,
    deploy_local,
    node_bundle_dir,
    rounds_logged,
    run_config_toml,
)
from fed_train.evaluation import format_table
from fed_train.flower.expected import expectation_line
from fed_train.flower.pki import make_node_key, make_server_tls
from fed_train.flower.settings import FlowerSettings
from fed_train.knn_request import KNNRequest
from fed_train.run import RunConfig, read_config
from knnper_cli.commands import help_of
from knnper_cli.training_args import (
    add_setting_flags,
    add_training_arguments,
    config_from_args,
    from_flags,
)


def settings_from_args(args: argparse.Namespace) -> FlowerSettings:
    return FlowerSettings(
        run=config_from_args(args),
        run_dir=args.out,
        algorithm=args.algorithm,
        round_timeout=args.round_timeout,
        connect_timeout=args.connect_timeout,
        min_train_clients=args.min_train_clients,
        eval_methods=tuple(args.eval_methods),
        knn=KNNRequest.from_args(args),
        capacity=args.capacity,
    )


def _cmd_deploy_local(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    # --clients, --insecure and --startup-timeout as flagged
    federation = from_flags(LocalFederation, args, device=str(resolve_device(args.device)))
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop = Ctrl-C
    try:
        first_round = len(rounds_logged(Path(args.out)))  # a resumed run's earlier rounds
        record = deploy_local(settings, federation, progress=not args.no_progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_table(record["evaluation"]))
    traffic = record["superlink_run"].get("network-traffic", {})
    print(
        f"trained {settings.run.training.rounds} rounds on Flower into {args.out} "
        f"({traffic.get('total-bytes', '?')} bytes through the SuperLink)"
    )
    print(expectation_line(settings.run))
    split = round_split(rounds_logged(Path(args.out))[first_round:])
    if split:
        print(split)
    return 0


def release_settings(args: argparse.Namespace) -> FlowerSettings:
    """The push of `args.release` to the nodes of `args.run`'s clients (`deploy release`, and
    `deploy config --release` for a federation of one's own), checked before anything starts:
    the release is an export that holds a bundle for every client of the run."""
    release = Path(args.release).resolve()
    try:
        record = read_release(release)
    except ReleaseError as err:
        raise DeployError(str(err)) from None
    if record is None:
        raise DeployError(
            f"{args.release} is not a release (no {RELEASE_FILE}): run `knnper export`"
        )
    run = RunConfig.from_dict(read_config(Path(args.run)))
    missing = [
        c
        for c in range(run.clients)
        if c not in record.clients or not record.bundle_dir(release, c).is_dir()
    ]
    if missing:
        raise DeployError(
            f"{args.release} holds no bundle for client(s) {missing[:10]} of {args.run}'s "
            f"{run.clients}: export every client (--clients all) of that run"
        )
    return FlowerSettings(
        run=run,
        run_dir=args.out,
        round_timeout=args.round_timeout,
        connect_timeout=args.connect_timeout,
        release=str(release),
        keep_inputs=args.keep_inputs,
        force_upgrade=args.force,
    )


def _cmd_deploy_release(args: argparse.Namespace) -> int:
    settings = release_settings(args)
    if args.trusted_key is not None:  # a key no node could read fails here, not on the nodes
        load_public_key(args.trusted_key)
    federation = from_flags(  # --insecure and --startup-timeout as flagged
        LocalFederation,
        args,
        clients=settings.run.clients,
        bundle_dir=Path(args.bundle_dir),
        trusted_key=None if args.trusted_key is None else Path(args.trusted_key),
    )
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop = Ctrl-C
    try:
        record = deploy_local(settings, federation)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_release_table(record["nodes"], Path(args.bundle_dir)))
    traffic = record["superlink_run"].get("network-traffic", {})
    print(
        f"{len(record['nodes'])} node(s) on release {args.release}; from the nodes to the "
        f"SuperLink: {traffic.get('inbound-bytes', '?')} bytes (counts, accuracies and "
        "versions: no sample leaves a node)"
    )
    return 0


def format_release_table(nodes: dict[int, dict[str, Any]], bundle_dir: Path) -> str:
    """One row per node: what it did to its bundle and how its test accuracy moved."""

    def pct(row: dict[str, Any], key: str) -> str:
        return f"{100 * row[key]:.1f}" if key in row else "-"

    def cell(text: str) -> str:  # a node's text stays in its cell: no row or column of its own
        return "".join(
            "\\|" if c == "|" else (repr(c)[1:-1] if not c.isprintable() else c) for c in text
        )

    lines = [
        "| client | bundle | did | stored | added | carried | test % before | after | version |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for cid, row in sorted(nodes.items()):
        did = (
            "built"
            if row["built"]
            else (cell(row.get("how", "")) if row["upgraded"] else "current")
        )
        lines.append(
            f"| {cid} | {node_bundle_dir(bundle_dir, int(cid))} | {did} | {row['stored']} | "
            f"{row.get('added', '-')} | {row.get('carried', '-')} | "
            f"{pct(row, 'test-accuracy-before')} | {pct(row, 'test-accuracy')} | "
            f"{cell(row.get('version', ''))} |"
        )
    return "\n".join(lines)


def round_split(rows: list[dict[str, Any]]) -> str | None:
    """Where a round's time went: the clients train side by side, so the round waits for the
    slowest one's training; the rest is Flower's own floor on this machine. The summed
    training is what `knnper train` does one client after another."""
    timed = [r for r in rows if "train_seconds" in r]
    if not timed:
        return None
    wall = sum(r["seconds"] for r in timed) / len(timed)
    summed = sum(r["train_seconds"] for r in timed) / len(timed)
    slowest = sum(r["train_seconds_max"] for r in timed) / len(timed)
    return (
        f"per round (mean of {len(timed)}): {wall:.1f} s on Flower = {slowest:.2f} s of "
        f"training on the slowest client ({summed:.2f} s summed over the clients, which "
        f"share this machine's cores) + {max(0.0, wall - slowest):.1f} s Flower's floor: a "
        "new ClientApp process per message that imports torch and flwr again, and 3 s "
        "polls (docs/benchmarks/flower.md)"
    )


def _cmd_deploy_config(args: argparse.Namespace) -> int:
    if (args.release is None) != (args.run is None):
        raise DeployError("--release and --run go together: the export and the run it is of")
    if args.release is None:
        if args.keep_inputs or args.force:
            raise DeployError("--keep-inputs and --force are for a push: give --release and --run")
        settings = settings_from_args(args).check()
    else:
        settings = release_settings(args).check()
        if (Path(settings.release) / "client_0000" / SIGNATURE_FILE).is_file():
            print(
                "note: the release is signed: a SuperNode verifies it when its --node-config "
                'names the public key, trusted-key="keys/signing.pub"; one without takes it '
                "unverified",
                file=sys.stderr,
            )
    settings.run_dir = str(Path(args.out).resolve())
    text = run_config_toml(settings)
    if args.write and not is_stdout(args.write):
        write_output(args.write, text.encode("utf-8"))
        print(f"wrote {args.write}: flwr run {APP_DIR} SUPERLINK --run-config {args.write}")
    else:
        print(text, end="")
    return 0


def _cmd_deploy_certs(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise DeployError(f"{out} is not empty; certificates and keys are never overwritten")
    tls = make_server_tls(out, args.host)
    print(
        f"wrote {tls.ca_cert} (give it to every SuperNode), {tls.cert} and {tls.key} (for "
        f"the SuperLink on {args.host} only)"
    )
    for i in range(args.supernode_keys):
        key = make_node_key(out / "supernodes", f"supernode-{i}")
        print(
            f"wrote {key.private} (for SuperNode {i} only) and {key.public} (register it: "
            f"flwr supernode register {key.public} SUPERLINK)"
        )
    return 0


def _add_federation_arguments(p: argparse.ArgumentParser, round_help: str) -> None:
    """The server's waits and the local federation's transport, alike for training and push."""
    add_setting_flags(
        p,
        FlowerSettings(),
        round_timeout=(positive_float, round_help),
        connect_timeout=(positive_float, "seconds the server waits for every client's SuperNode"),
    )


def _add_local_federation_arguments(p: argparse.ArgumentParser) -> None:
    """How `local` and `release` start their federation on 127.0.0.1."""
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=60.0,
        help="seconds the SuperLink may take to start listening",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no TLS and no SuperNode authentication (never across machines)",
    )


def _add_settings_arguments(p: argparse.ArgumentParser) -> None:
    """The training flags of `local` and `config`: those of `knnper train` and Flower's own."""
    from fed_train.defaults import CHECKPOINT_EVERY

    d = FlowerSettings()
    add_training_arguments(p)
    p.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=CHECKPOINT_EVERY,
        help="rounds between checkpoints",
    )
    add_setting_flags(p, d, algorithm=", ".join(federated_methods()))
    p.add_argument(
        "--eval-methods",
        nargs="+",
        default=["fedavg", "knnper"],
        help="personalizations evaluated on the clients after training",
    )
    p.add_argument(
        "--continue-from",
        metavar="RUN",
        default=None,
        help="continue training a finished run's model, as `knnper train --continue-from`",
    )
    KNNRequest.add_arguments(p)
    add_setting_flags(
        p, d, capacity=(fraction, "fraction of each client's train split kept in its datastore")
    )
    _add_federation_arguments(p, "seconds the server waits for a round's replies")
    add_setting_flags(
        p, d, min_train_clients=(count, "replies a round needs to go on (0: every sampled client)")
    )


def _add_push_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keep-inputs",
        action="store_true",
        help="a bundle built on a node keeps its raw inputs (upgrades re-embed them exactly)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="upgrade with the release's key map even where it advises to keep the old keys",
    )


_LOCAL_EXAMPLE = "knnper deploy local --dataset digits --clients 5 --rounds 5 --out runs/flower"
_CERTS_EXAMPLE = "knnper deploy certs --host fl.example.org --supernode-keys 20 --out keys/pki"


def _add_local(where: argparse._SubParsersAction) -> None:
    """`deploy local`: train on a whole federation on this machine."""
    local = command(
        "local",
        _cmd_deploy_local,
        help="a whole federation on 127.0.0.1: one SuperLink, one SuperNode per client, TLS "
        "and SuperNode authentication",
        epilog=examples(_LOCAL_EXAMPLE),
    ).add_to(where)
    _add_settings_arguments(local)
    local.add_argument(
        "--out",
        required=True,
        type=output_dir,
        help="run directory (the same layout as `knnper train` writes)",
    )
    _add_local_federation_arguments(local)


def _add_config(where: argparse._SubParsersAction) -> None:
    """`deploy config`: the `flwr run` config of a training, or of a push (--release)."""
    config = command(
        "config",
        _cmd_deploy_config,
        help="the run config file for `flwr run` against a SuperLink of your own (real machines)",
        epilog=examples(
            "knnper deploy config --dataset fashion-mnist --clients 20 --rounds 20 "
            "--out /srv/runs/fl --write runs/fl.toml"
        ),
    ).add_to(where)
    _add_settings_arguments(config)
    config.add_argument(
        "--out", required=True, help="run directory on the machine that runs the ServerApp"
    )
    config.add_argument(
        "--release",
        default=None,
        help="instead of training, push this `knnper export` directory to the nodes' bundles, "
        "as `deploy release` does (with --run; the training flags then do not apply)",
    )
    config.add_argument(
        "--run", default=None, help="with --release: the run the release was exported from"
    )
    _add_push_arguments(config)
    config.add_argument(
        "--write",
        default=None,
        type=output_file_or_stdout,
        help="write the TOML here (default, - or /dev/stdout: standard output; "
        "an existing path must be a regular file or a link to one)",
    )


def _add_release(where: argparse._SubParsersAction) -> None:
    """`deploy release`: push an export to a local federation's devices."""
    push = command(
        "release",
        _cmd_deploy_release,
        help="push an export to a local federation's devices: each SuperNode builds its own "
        "bundle from its own data and learns, or upgrades the bundle it has",
        epilog=examples(
            "knnper deploy release bundles/fl-v1 --run runs/fl-v1 --bundle-dir "
            "bundles/fl-devices --out runs/fl-v1-devices"
        ),
    ).add_to(where)
    push.add_argument("release", help="a `knnper export` directory (the release)")
    push.add_argument(
        "--run",
        required=True,
        help="the run the release was exported from (the nodes draw their clients' data as it did)",
    )
    push.add_argument(
        "--bundle-dir",
        required=True,
        help="the devices' bundles: node N keeps its own in BUNDLE_DIR/node-N",
    )
    push.add_argument(
        "--out", required=True, type=output_dir, help="where flower.json and the logs go"
    )
    _add_push_arguments(push)
    push.add_argument(
        "--trusted-key",
        default=None,
        metavar="PUBLIC_KEY",
        help="every node refuses a release not signed by this Ed25519 key (`knnper export "
        "--signing-key`); default: nodes take unsigned releases",
    )
    _add_federation_arguments(push, "seconds the server waits for the nodes' replies")
    _add_local_federation_arguments(push)


def _add_certs(where: argparse._SubParsersAction) -> None:
    """`deploy certs`: the PKI of a federation across machines."""
    certs = command(
        "certs",
        _cmd_deploy_certs,
        help="a CA, the SuperLink's TLS certificate and SuperNode key pairs for a federation "
        "across machines",
        epilog=examples(_CERTS_EXAMPLE),
    ).add_to(where)
    certs.add_argument(
        "--host",
        required=True,
        help="the SuperLink's address as SuperNodes reach it (DNS name or IP)",
    )
    certs.add_argument(
        "--supernode-keys", type=count, default=0, help="SuperNode authentication key pairs to make"
    )
    certs.add_argument("--out", required=True, type=output_dir, help="an empty or new directory")


def add_deploy_command(sub: argparse._SubParsersAction) -> None:
    """`knnper deploy` and its four subcommands: local, config, release, certs."""
    p = sub.add_parser(
        "deploy", help=help_of("deploy"), epilog=examples(_LOCAL_EXAMPLE, _CERTS_EXAMPLE)
    )
    where = p.add_subparsers(dest="where", required=True, parser_class=type(p))
    for add in (_add_local, _add_config, _add_release, _add_certs):
        add(where)
