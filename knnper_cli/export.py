"""`knnper export`: per-device bundles from a finished run, each sized to its device's memory
budget and running the run's kNN-Per configuration."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edge_runtime.arg_types import byte_count, output_dir, positive_int, seed
from edge_runtime.budget import Budget
from edge_runtime.cli_help import examples
from edge_runtime.commands import command
from export.errors import BudgetInvalid
from export.options import DEVICE_EXTRAS, backend_choices
from export.profiles import (
    PROFILES,
    load_budgets,
    lognormal_budgets,
    uniform_budgets,
    weak_strong_budgets,
)
from fed_train.knn_request import KNNRequest
from knnper_cli.commands import help_of

if TYPE_CHECKING:  # torch loads with these: the command imports them when it runs
    from export.exporter import ExportSettings
    from fed_train.knn_setting import KNNConfig
    from fed_train.run import LoadedRun


def add_export_command(sub: argparse._SubParsersAction) -> None:
    """`knnper export RUN --out DIR` and its flags, by group."""
    p = command(
        "export",
        _cmd_export,
        help=help_of("export"),
        epilog=examples(
            "knnper export runs/fmnist --out bundles/500k --budget 500kB",
            "knnper export runs/fmnist --out bundles/weak-strong --profile "
            "weak-strong --reference 2MB --delta-c 0.3",
            note="HNSW bundles need the hnsw extra (hnswlib) on the device, "
            "and `knnper-edge export-onnx` cannot make one ONNX file of them. "
            "With --backend auto the export says so before writing any bundle "
            "and names the clients that got one at the end; --device-extras "
            "none leaves HNSW out, so every bundle loads on the runtime alone.",
        ),
    ).add_to(sub)
    p.add_argument("run", help="run directory written by `knnper train`")
    p.add_argument(
        "--out", required=True, type=output_dir, help="directory for the bundles and export.json"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace another release that --out holds, whole, and bundles in --out that "
        "`knnper-edge add` has taught since they were exported (they lose what their "
        "devices learned); both refused without it",
    )
    _add_budget_arguments(p)
    _add_bundle_arguments(p)
    _add_search_arguments(p)
    add_upgrade_arguments(p)


def _add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """Each device's memory budget: from a file, one for all, or a generated profile."""
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budgets", metavar="FILE", help="JSON file {client_id: bytes}")
    budget.add_argument(
        "--budget",
        type=byte_count,
        metavar="BYTES",
        help="one budget for every device (500000, 500kB, 1.5MB, 2MiB)",
    )
    budget.add_argument("--profile", help=f"generated budgets: {', '.join(PROFILES[1:])}")
    p.add_argument(
        "--reference",
        type=byte_count,
        metavar="BYTES",
        help="reference budget in bytes for --profile (weak-strong: the devices get "
        "(1/2 -+ delta_c) of it; lognormal: its median)",
    )
    p.add_argument(
        "--delta-c",
        type=float,
        default=0.25,
        metavar="D",
        help="weak-strong: half the devices at (1/2 - D), half at (1/2 + D)",
    )
    p.add_argument("--spread", type=float, default=0.5, help="lognormal: sigma of log(budget)")


def _add_bundle_arguments(p: argparse.ArgumentParser) -> None:
    """What a bundle may hold: its datastore backends, encoder precision, clients, kNN setting."""
    p.add_argument(
        "--backend",
        default="auto",
        help=f"datastore backend: {', '.join(backend_choices())} (auto tries all)",
    )
    p.add_argument(
        "--device-extras",
        choices=DEVICE_EXTRAS,
        default="any",
        help="none: try only datastores the device runtime loads without extras "
        "and that `knnper-edge export-onnx` can make one file of (no HNSW); any: "
        "HNSW too, where it is the most accurate (the device then needs the hnsw "
        "extra)",
    )
    p.add_argument("--quantize", default="int8", help="encoder precision: int8 or fp32")
    p.add_argument("--clients", default="all", help="all, seen, unseen, or ids like 0,3,7")
    KNNRequest.add_arguments(p)
    p.add_argument(
        "--update-strategy",
        default="fifo",
        help="on-device updates: fifo, concatenate, fixed (a protonn bundle "
        "buffers new samples beside its prototypes)",
    )


def _add_search_arguments(p: argparse.ArgumentParser) -> None:
    """How the export searches and signs: seed, workers, pruning, key, raw inputs."""
    p.add_argument(
        "--seed",
        type=seed,
        default=0,
        help="seed of generated budgets and of datastore sampling / ProtoNN training",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="processes sizing clients in parallel (default: one per usable core)",
    )
    p.add_argument(
        "--pruned-search",
        action="store_true",
        help="skip HNSW and ProtoNN candidates that look unable to win and train "
        "ProtoNN candidates by successive halving: faster, but it lost accuracy "
        "against the exhaustive search (docs/benchmarks/export.md)",
    )
    p.add_argument(
        "--signing-key",
        metavar="PRIVATE.pem",
        default=None,
        help="sign every bundle with this Ed25519 private key (knnper-edge keygen "
        "makes one); devices given the public key refuse unsigned bundles",
    )
    p.add_argument(
        "--keep-inputs",
        action="store_true",
        help="every bundle also keeps its stored samples' raw inputs (counted in its budget, "
        "so it holds fewer keys), and `knnper-edge upgrade` re-embeds them exactly; flat and "
        "hnsw only (auto leaves protonn out)",
    )


def add_upgrade_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--upgrade-from",
        metavar="OLD_EXPORT",
        default=None,
        help="an earlier export these bundles replace: also write upgrades/from-"
        "<old encoder>.npz, the map devices carry their keys over with "
        "(`knnper-edge upgrade`), fitted and judged on server-held data only",
    )
    p.add_argument(
        "--public-data",
        metavar="NPZ",
        default=None,
        help="server-held data (x_train, y_train) the key map is fitted on "
        "(default: the split the run's pretraining kept for the server)",
    )


def budgets_from_args(args: argparse.Namespace, client_ids: list[int]) -> dict[int, Budget]:
    """Each client's budget, from --budgets, --budget or --profile."""
    if args.budgets:
        return load_budgets(args.budgets, client_ids)
    if args.budget is not None:
        return uniform_budgets(client_ids, args.budget)
    if args.profile not in PROFILES[1:]:
        raise BudgetInvalid(f"unknown --profile {args.profile!r}; known: {', '.join(PROFILES[1:])}")
    if args.reference is None:
        raise BudgetInvalid(f"--profile {args.profile} needs --reference BYTES")
    if args.profile == "weak-strong":
        return weak_strong_budgets(client_ids, args.reference, args.delta_c, args.seed)
    return lognormal_budgets(client_ids, args.reference, args.spread, args.seed)


def format_export_table(report: dict[str, Any]) -> str:
    """One line per client: budget, chosen backend and recipe, bytes, validation accuracy."""
    head = (*"client seen budget backend recipe stored bytes lambda".split(), "val acc %")
    rows = [head]
    for r in report["clients"]:
        acc = "-" if r["val_accuracy"] is None else f"{100 * r['val_accuracy']:.1f}"
        cells = (r[key] for key in ("budget", "backend", "recipe", "stored", "total_bytes"))
        seen = "no" if r["unseen"] else "yes"
        rows.append((str(r["client_id"]), seen, *map(str, cells), f"{r['lambda']:.1f}", acc))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    enc = report["encoder"]
    lines.append(
        f"encoder: {enc['quantize']} {enc['bytes']} bytes (fp32 {enc['fp32_bytes']} "
        f"bytes, max |onnx - torch| {enc['torch_max_abs_diff']:.1e})"
    )
    return "\n".join(lines)


def format_export_summary(report: dict[str, Any]) -> str:
    """One line per distinct budget: how many clients, which backends were chosen, mean bytes
    and mean validation accuracy (a fleet's export in a few lines)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in report["clients"]:
        groups.setdefault(r["budget"], []).append(r)
    lines = [
        "| budget | clients | chosen backends | mean bytes | mean val acc % |",
        "|---|---|---|---|---|",
    ]
    for budget in sorted(groups):
        rows = groups[budget]
        chosen = Counter(r["backend"] for r in rows)
        accs = [r["val_accuracy"] for r in rows if r["val_accuracy"] is not None]
        acc = f"{100 * sum(accs) / len(accs):.1f}" if accs else "-"
        lines.append(
            f"| {budget} | {len(rows)} | "
            f"{', '.join(f'{b} {n}' for b, n in sorted(chosen.items()))} | "
            f"{sum(r['total_bytes'] for r in rows) / len(rows):.0f} | {acc} |"
        )
    return "\n".join(lines)


PER_CLIENT_TABLE_MAX = 20  # above this many clients, only the summary is printed


def _cmd_export(args: argparse.Namespace) -> int:
    # imported here, not above: `knnper export` parses its flags before torch and onnx load
    from edge_runtime.errors import one_line
    from export.errors import ExportError
    from export.exporter import (
        apply_knn_choice,
        export_run,
        refuse_budgets_below_encoder,
        select_ids,
    )
    from export.upgrade_map import old_release, server_data
    from fed_train.errors import KnnperError
    from fed_train.knn_choice import load_or_choose
    from fed_train.run import load_run

    settings = _export_settings(args)  # bad flags fail before the run is loaded
    if args.public_data is not None and args.upgrade_from is None:  # it was silently unused
        raise ExportError(
            "--public-data is the data --upgrade-from's key map is fitted on: give "
            "--upgrade-from OLD_EXPORT too, or leave it out"
        )
    request = KNNRequest.from_args(args)
    try:
        run = load_run(args.run)
    except KnnperError as err:
        # torch's own message for a corrupt checkpoint runs over several lines; one is enough.
        raise ExportError(one_line(err, first_line=True)) from err
    # the budgets need no model but its weights' count: a bad one fails before the kNN setting
    # is chosen (minutes) and the encoder is exported
    budgets = budgets_from_args(args, select_ids(run.partition.unseen, args.clients))
    refuse_budgets_below_encoder(run, budgets, settings.quantize)
    choice = load_or_choose(
        run.run_dir,
        run.model,
        run.clients(),
        request,
        seed=run.config.seed,
        progress=not args.no_progress,
    )
    print(choice.describe())
    settings = apply_knn_choice(settings, choice)
    replaces, server = None, None
    if args.upgrade_from is not None:  # both checked before any bundle is written
        replaces = old_release(Path(args.upgrade_from))
        server = server_data(run, args.public_data)
    report = export_run(
        run,
        Path(args.out),
        budgets,
        settings,
        clients=args.clients,
        progress=not args.no_progress,
        workers=args.workers,
        force=args.force,
        replaces=replaces,
    )
    _print_report(report, Path(args.out))
    if server is not None:
        _write_upgrade_map(args, run, server, choice.config)
    return 0


def _export_settings(args: argparse.Namespace) -> ExportSettings:
    """The export's settings from the flags, checked: a bad flag raises before any run loads."""
    from export.exporter import ExportSettings
    from knnper_cli.training_args import from_flags

    settings = from_flags(ExportSettings, args)
    if args.pruned_search:
        settings.space = settings.space.pruned()
    settings.check()
    return settings


def _print_report(report: dict[str, Any], out: Path) -> None:
    """The export's tables, a warning for bundles that need a device extra, and where it wrote."""
    from edge_runtime.release import RELEASE_FILE
    from export.exporter import device_extra, needing_extras

    if len(report["clients"]) <= PER_CLIENT_TABLE_MAX:
        print(format_export_table(report))
    print(format_export_summary(report))
    for backend, ids in needing_extras(report["clients"]).items():
        shown = ", ".join(map(str, ids[:20])) + (" ..." if len(ids) > 20 else "")
        print(
            f"{len(ids)} of {len(report['clients'])} bundle(s) use {backend} (client "
            f"{shown}): a device loads them only with the {device_extra(backend)} "
            "extra, and `knnper-edge export-onnx` cannot make one file of them; "
            "--device-extras none avoids it"
        )
    print(f"wrote {len(report['clients'])} bundle(s) and {out / RELEASE_FILE}")


def _write_upgrade_map(
    args: argparse.Namespace, run: LoadedRun, server: tuple[Any, Any], knn: KNNConfig
) -> None:
    """--upgrade-from: the key map from the old release's encoder to this one's, and its line.

    Parameters
    ----------
    run : LoadedRun
        The run exported.
    server : tuple of ndarray
        The server-held inputs and labels the map is fitted on (`server_data`).
    knn : KNNConfig
        The chosen kNN setting (k and sigma judge the map).
    """
    from edge_runtime.signing import load_private_key
    from export.upgrade_map import write_upgrade_map

    key = load_private_key(args.signing_key) if args.signing_key else None
    path, fit = write_upgrade_map(
        Path(args.upgrade_from),
        Path(args.out),
        *server,
        run.dataset.input_spec,
        run.dataset.num_classes,
        k=knn.k,
        sigma=knn.sigma,
        seed=args.seed,
        signing_key=key,
    )
    print(
        f"wrote {path} ({fit.chosen.name()}, chosen by cross-validation on "
        f"{fit.fit_samples} server samples): {fit.key_map.describe()}"
    )
