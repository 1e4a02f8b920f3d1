"""`knnper experiment model-update`: how much a device keeps of what it learned when the global
model changes, by upgrade path, across version gaps.

Per seed: a pretraining whose server split only the server holds; release v1 (FedAvg for
`rounds` rounds from it); three successors, "continued" (v1 trained `rounds` more rounds,
`--continue-from`), "retrained" (another training from the same pretraining, learning rate
halved, 2 x `rounds` rounds: the same clients and starting weights, another model) and
"independent" (v1's recipe from a second pretraining on the very same server split but from
other initial weights and batch order, `knnper pretrain --weights-seed`: the same clients, an
encoder trained apart, the gap where stale keys lose most); each exported with a key map from
v1 fitted on the server split, its kNN setting chosen on validation with v1's normalisation
(the normalisation is in the encoder's graph: a change of it would count as a change of
encoder). Each seen client is a device. It builds its v1 bundle from
its train split (flat:int8, fifo; its raw inputs kept, and a copy holding the same samples
without them: checked key for key), then, between the versions, learns from a stream under the
project's distribution-shift protocol (experiments.distribution_shift: `steps` batches of
`batch` labelled test images, labels from its train split's distribution before `shift_at`
and from a shifted Dirichlet(`alpha`) draw from then on), adding every batch to both copies.
It is scored on `eval_samples` further test images drawn from the shifted distribution (what
the device sees now; none of them was added), for each path:

- no upgrade: the v1 bundle as it is (old encoder, old keys);
- stale: the new encoder's queries against the old keys (what an unversioned runtime would
  silently do; knnper refuses it, so it is computed here by hand), searched with the new
  release's k and sigma and mixed with the mapped bundle's lambda and base, so that stale and
  mapped differ in the keys alone (each release chooses its own kNN setting on validation:
  v1's and the release's are both in clients.csv);
- mapped: `upgrade` with the release's map (the copy without raw inputs);
- exact: `upgrade` of the copy that kept its raw inputs (re-embedded);
- fresh: the release's own bundle for the client (its train split, the device's additions
  forgotten).

stale, mapped and exact hold the same samples; the budget should leave room for the whole
train split and the stream beside the raw inputs (`stored` and `fresh_stored` in clients.csv
say what each held). Each seed's rows are kept in seed_S/rows.json, so seeds run as separate
invocations into one OUT pool into one report. Outputs in OUT/model-update: clients.csv (every
client, seed, gap, path), points.csv (mean over clients per seed, gap and path), summary.md
(mean +- standard deviation across seeds; the issue's targets judged on paired bootstrap 95%
intervals, clients resampled within their seed; the share of clients each path leaves below
another), model_update.png."""

from __future__ import annotations

import argparse
import copy
import io
import json
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_runtime._io import csv_text, read_json_cache, write_bytes_atomic, write_text_atomic
from edge_runtime.budget import Budget
from edge_runtime.datastores import EXACT_BACKEND, format_recipe, recipe_without
from edge_runtime.device_choice import InitSettings
from edge_runtime.device_init import init_bundle
from edge_runtime.knn import softmax
from edge_runtime.release import read_release
from edge_runtime.runtime import Runtime
from experiments.distribution_shift import TestPool, shifted_distribution
from experiments.margins import call, interval, pp
from experiments.report import pyplot
from experiments.table_seeds import hurt_share, paired_bootstrap
from export.exporter import ExportSettings, apply_knn_choice, bundle_dir, export_run
from export.upgrade_map import old_release, server_data, write_upgrade_map
from fed_train.client_files import client_split
from fed_train.knn_choice import load_or_choose
from fed_train.knn_request import KNNRequest
from fed_train.pretrain import PretrainConfig, pretrain
from fed_train.run import RunConfig, load_run, read_config, train

PATHS = ("no upgrade", "stale", "mapped", "exact", "fresh")
GAPS = ("continued", "retrained", "independent")
# the gaps the 80% recovery target is judged on: retrainings (the "after a retraining")
RECOVERY_GAPS = ("retrained", "independent")
# the independent gap's pretraining: weights seed = the seed + this (its split seed is the seed)
INDEPENDENT_WEIGHTS = 10_000
ROWS_FILE = "rows.json"  # one seed's rows: a finished seed is read back, not measured again
# the clients-hurt table: (path, the path it is set against)
HURT_PAIRS = (
    ("mapped", "exact"),
    ("mapped", "stale"),
    ("mapped", "no upgrade"),
    ("exact", "no upgrade"),
    ("fresh", "exact"),
)
TARGET_BEHIND_EXACT = 0.005  # mapped within 0.5 pp of exact, in mean over gaps and seeds
TARGET_RECOVERED = 0.8  # after a retraining, at least 80% of what stale keys lose


@dataclass
class UpdateSettings:
    """The scale of the experiment (what the command line sets)."""

    dataset: str = "digits"
    data: str | None = None
    clients: int = 10
    rounds: int = 5
    pretrain_epochs: int = 3
    server_fraction: float = 0.2
    budget: int = 1_000_000
    max_train: int | None = None
    steps: int = 10
    shift_at: int = 3
    batch: int = 20
    alpha: float = 0.3
    eval_samples: int = 200


def _release(root: Path, name: str, config: RunConfig) -> Path:
    run_dir = root / name
    if not (run_dir / "model.pt").is_file():
        train(config, run_dir, progress=False)
    return run_dir


def _export(
    run_dir: Path, out: Path, budget: int, upgrade_from: Path | None, normalize: str | None
) -> str:
    """Export the run's seen clients (with a key map from `upgrade_from`), its kNN setting
    chosen on validation with the normalisation pinned to `normalize` where given; returns the
    normalisation it runs."""
    run = load_run(run_dir)
    choice = load_or_choose(
        run.run_dir, run.model, run.clients(), KNNRequest(normalize=normalize), seed=run.config.seed
    )
    release = read_release(out)
    if release is not None and release.finished:
        return choice.config.normalize
    settings = apply_knn_choice(ExportSettings(backend=EXACT_BACKEND, device_extras="none"), choice)
    seen = [c for c in range(len(run.partition.clients)) if not run.partition.unseen[c]]
    replaces = None if upgrade_from is None else old_release(upgrade_from)
    export_run(
        run,
        out,
        {c: Budget(budget) for c in seen},
        settings,
        clients="seen",
        progress=False,
        workers=1,
        replaces=replaces,
    )
    if upgrade_from is not None:
        x, y = server_data(run, None)
        write_upgrade_map(
            upgrade_from,
            out,
            x,
            y,
            run.dataset.input_spec,
            run.dataset.num_classes,
            k=choice.config.k,
            sigma=choice.config.sigma,
            seed=run.config.seed,
        )
    return choice.config.normalize


def shifted_stream(
    run: Any, y_train: np.ndarray, settings: UpdateSettings, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_added, y_added, x_eval, y_eval): what a device learns between the versions under the
    distribution-shift protocol (experiments.distribution_shift: test images, labels from the
    train split's distribution, then from a shifted Dirichlet draw from `shift_at` on), and the
    images it is scored on afterwards (the shifted distribution; drawn from the same pool
    without replacement, so none of them was added)."""
    num_classes = run.dataset.num_classes
    before = np.bincount(y_train, minlength=num_classes) / len(y_train)
    after = shifted_distribution(
        before, argparse.Namespace(shift="dirichlet", alpha=settings.alpha), rng
    )
    pool = TestPool(run.dataset.y_test, num_classes, rng)
    y_added = np.concatenate(
        [
            rng.choice(
                num_classes, size=settings.batch, p=before if t < settings.shift_at else after
            )
            for t in range(settings.steps)
        ]
    ).astype(np.int64)
    y_eval = rng.choice(num_classes, size=settings.eval_samples, p=after).astype(np.int64)
    added = [pool.draw(int(c)) for c in y_added]
    scored = [pool.draw(int(c)) for c in y_eval]
    return run.dataset.x_test[added], y_added, run.dataset.x_test[scored], y_eval


def _accuracy(rt: Runtime, x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """(kNN-Per's accuracy, the datastore's alone, the bundle's lambda)."""
    local, _ = rt.components(x)
    return (float((rt.predict(x) == y).mean()), float((local.argmax(1) == y).mean()), float(rt.lam))


def _stale(
    old: Runtime, mapped: Runtime, x: np.ndarray, y: np.ndarray
) -> tuple[float, float, float]:
    """The new encoder's queries searched against the old keys (by hand: knnper refuses it)
    with the new release's k and sigma, interpolated with the mapped bundle's lambda and base
    (the new encoder's logits: its linear head, if any, and normalisation are in its graph);
    and the old keys' kNN alone."""
    z, logits = mapped.embed(x)
    keys = copy.copy(old.datastore)
    keys.k, keys.sigma = mapped.datastore.k, mapped.datastore.sigma
    local = keys.predict_proba(z)
    p = mapped.lam * local + (1 - mapped.lam) * softmax(logits)
    return (
        float((p.argmax(1) == y).mean()),
        float((local.argmax(1) == y).mean()),
        float(mapped.lam),
    )


def _knn_setting(rt: Runtime) -> dict[str, Any]:
    """The kNN setting a bundle runs (each release chose its own on validation)."""
    return {
        "k": rt.datastore.k,
        "sigma": rt.datastore.sigma,
        "normalize": rt.manifest.normalize,
        "base": rt.manifest.base,
    }


def _same_clients(v1: Path, successor: Path, gap: str) -> None:
    """Every successor must train on v1's clients, sample for sample (the data fingerprint
    covers the data set and the partition): a gap that changed the data would not be an
    update of the same devices' model."""
    before, after = (read_config(r).get("data_sha256") for r in (v1, successor))
    if before is None or before != after:
        raise RuntimeError(
            f"{successor} ({gap}) trained on other data than {v1} (data fingerprint "
            f"{after} against {before})"
        )


def _same_samples(a: Runtime, b: Runtime) -> None:
    """The bundle with raw inputs and the one without must hold the same keys: the paths are
    compared on the same memory, or not at all."""
    if not (
        np.array_equal(a.datastore.labels_, b.datastore.labels_)
        and np.array_equal(a.datastore.keys(), b.datastore.keys())
    ):
        raise RuntimeError(
            f"{a.path} and {b.path} hold different samples "
            f"({len(a.datastore)} and {len(b.datastore)}): the paths would not be comparable"
        )


def _device(
    run: Any,
    client: int,
    encoder: Path,
    v1: Runtime,
    settings: UpdateSettings,
    seed: int,
    devices: Path,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray] | None:
    """The client's v1 bundles ("kept": raw inputs kept, "plain": the same samples without
    them), built by a device's `init` from the v1 release's `encoder` with the k and sigma
    that release chose on validation (`v1`: its bundle for the client), after the shifted
    stream was added to both; (facts, x_eval, y_eval), or None for a client with too little
    data."""
    x_tr, y_tr = client_split(run, client, "train")
    if len(y_tr) < 2:
        return None
    x_add, y_add, x_eval, y_eval = shifted_stream(
        run, y_tr, settings, np.random.default_rng([seed, client])
    )
    shutil.rmtree(devices, ignore_errors=True)
    devices.mkdir(parents=True)
    spec = run.dataset.input_spec
    knn = {"k": v1.datastore.k, "sigma": v1.datastore.sigma}
    kept = init_bundle(
        encoder,
        x_tr,
        y_tr,
        settings.budget,
        devices / "kept",
        input_spec=spec,
        settings=InitSettings(
            **knn,
            recipes=[format_recipe(EXACT_BACKEND, {"dtype": "int8"})],
            keep_inputs=True,
            client_id=client,
            update_strategy="fifo",
        ),
    )
    # the plain bundle takes the recipe (its n) the one that keeps raw inputs could afford
    recipe = recipe_without(kept.recipe, "inputs")
    init_bundle(
        encoder,
        x_tr,
        y_tr,
        settings.budget,
        devices / "plain",
        input_spec=spec,
        settings=InitSettings(**knn, recipes=[recipe], client_id=client, update_strategy="fifo"),
    )
    evicted = 0
    for name in ("kept", "plain"):
        report = Runtime.load(devices / name).add(x_add, y_add)
        evicted = report.evicted
    loaded = {name: Runtime.load(devices / name) for name in ("kept", "plain")}
    _same_samples(loaded["kept"], loaded["plain"])
    facts = {
        "train": len(y_tr),
        "added": len(y_add),
        "stored": len(loaded["plain"].datastore),
        "evicted": evicted,
    }
    return facts, x_eval, y_eval


def run_seed(root: Path, settings: UpdateSettings, seed: int) -> list[dict[str, Any]]:
    """Every (client, gap, path) accuracy of one seed; releases and a finished seed's rows are
    reused when present."""
    root.mkdir(parents=True, exist_ok=True)
    saved = read_json_cache(root / ROWS_FILE)
    if saved is not None and same_protocol(saved, settings):
        return list(saved["rows"])
    v1, successors = _releases(root, settings, seed)
    b1 = root / "b1"
    # the successors run v1's normalisation: it is in each encoder's graph, so a release that
    # chose another would make stale keys lose by the change of norm, not of encoder
    normalize = _export(v1, b1, settings.budget, None, None)
    exports = {gap: root / f"b-{gap}" for gap in successors}
    for gap, run_dir in successors.items():
        _export(run_dir, exports[gap], settings.budget, b1, normalize)
    run = load_run(v1)
    rows = []
    for client in range(len(run.partition.clients)):
        if not run.partition.unseen[client]:
            rows += _client_rows(run, client, b1, exports, settings, seed, root / "devices")
    write_text_atomic(
        root / ROWS_FILE,
        json.dumps({"settings": asdict(settings), "gaps": list(GAPS), "rows": rows}, indent=0),
    )
    return rows


def _releases(root: Path, settings: UpdateSettings, seed: int) -> tuple[Path, dict[str, Path]]:
    """Release v1 (trained from a pretraining) and its successor by each gap: training
    continued from v1, retrained from the same start, and trained from an independent
    pretraining; each checked to hold v1's clients."""
    pre = _pretraining(root / "pre", settings, seed, None)
    base = RunConfig(
        dataset=settings.dataset,
        data=settings.data,
        clients=settings.clients,
        max_train=settings.max_train,
        seed=seed,
        init=str(pre.resolve()),
    )
    base = replace(base, training=replace(base.training, rounds=settings.rounds))
    v1 = _release(root, "v1", base)
    successors = {
        "continued": _release(
            root, "continued", replace(base, init=None, continue_from=str(v1.resolve()))
        ),
        "retrained": _release(
            root,
            "retrained",
            replace(
                base,
                training=replace(
                    base.training, rounds=2 * settings.rounds, lr=base.training.lr / 2
                ),
            ),
        ),
        "independent": _release(
            root,
            "independent",
            replace(
                base,
                init=str(
                    _pretraining(
                        root / "pre-independent", settings, seed, seed + INDEPENDENT_WEIGHTS
                    ).resolve()
                ),
            ),
        ),
    }
    for gap, run_dir in successors.items():
        _same_clients(v1, run_dir, gap)
    return v1, successors


def _client_rows(
    run: Any,
    client: int,
    b1: Path,
    exports: dict[str, Path],
    settings: UpdateSettings,
    seed: int,
    root: Path,
) -> list[dict[str, Any]]:
    """One client's rows: its device (from v1's bundle `b1`, grown on its stream) upgraded to
    each gap's release by every path, against a fresh bundle of that release."""
    devices = root / f"client_{client:04d}"
    v1_release = Runtime.load(bundle_dir(b1, client))
    device = _device(run, client, b1 / "encoder.onnx", v1_release, settings, seed, devices)
    if device is None:
        return []
    facts, x_eval, y_eval = device
    old = Runtime.load(devices / "plain")
    rows = []
    for gap, release in exports.items():
        target = bundle_dir(release, client)
        scores = {"no upgrade": _accuracy(old, x_eval, y_eval)}
        for name, path in (("plain", "mapped"), ("kept", "exact")):
            copy = devices / f"{name}-{gap}"
            shutil.copytree(devices / name, copy)
            rt = Runtime.load(copy)
            rt.upgrade(target, force=True)
            scores[path] = _accuracy(rt, x_eval, y_eval)
            if path == "mapped":
                scores["stale"] = _stale(old, rt, x_eval, y_eval)
        fresh = Runtime.load(target)
        scores["fresh"] = _accuracy(fresh, x_eval, y_eval)
        knn_settings = {
            **{f"v1_{key}": value for key, value in _knn_setting(v1_release).items()},
            **_knn_setting(fresh),
        }
        advice = json.loads(next((release / "upgrades").glob("*.json")).read_text())
        rows += [
            {
                "seed": seed,
                "gap": gap,
                "client": client,
                "path": path,
                "accuracy": scores[path][0],
                "knn_accuracy": scores[path][1],
                "lam": scores[path][2],
                "test_samples": len(y_eval),
                **facts,
                "fresh_stored": len(fresh.datastore),
                "advice": advice["advice"],
                **knn_settings,
            }
            for path in PATHS
        ]
    shutil.rmtree(devices, ignore_errors=True)
    return rows


def same_protocol(saved: dict[str, Any], settings: UpdateSettings) -> bool:
    """Whether a seed's saved rows were measured with these settings over these gaps (rows
    from before a gap was added are measured again; the releases on disk are reused)."""
    return saved.get("settings") == asdict(settings) and saved.get("gaps") == list(GAPS)


def _pretraining(out: Path, settings: UpdateSettings, seed: int, weights_seed: int | None) -> Path:
    """The pretraining on the seed's server split (the same split whatever `weights_seed`)."""
    if not (out / "pretrain.json").is_file():
        pretrain(
            PretrainConfig(
                dataset=settings.dataset,
                data=settings.data,
                server_fraction=settings.server_fraction,
                epochs=settings.pretrain_epochs,
                max_train=settings.max_train,
                seed=seed,
                weights_seed=weights_seed,
            ),
            out,
            progress=False,
        )
    return out


def _per_seed(
    rows: list[dict[str, Any]], column: str, gaps: tuple[str, ...]
) -> list[list[dict[str, Any]]]:
    """One list per seed of wide rows, one per (client, gap) of `gaps`: every path's accuracy
    in `column`, in the form experiments.table_seeds' paired bootstrap and clients-hurt take."""
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        wide: dict[tuple[str, int], dict[str, Any]] = {}
        for r in rows:
            if r["seed"] == seed and r["gap"] in gaps:
                row = wide.setdefault(
                    (r["gap"], r["client"]), {"unseen": False, "n_test": r["test_samples"]}
                )
                row[r["path"]] = r[column]
        out.append([wide[k] for k in sorted(wide)])
    return out


def _recovered(per_seed: list[list[dict[str, Any]]]) -> dict[str, float]:
    """What the mapped path recovers of what stale keys lose: (mapped - stale) / (exact -
    stale) on the seeds' mean accuracies, with a bootstrap 95% interval (clients resampled
    within their seed)."""
    arrays = [
        tuple(np.array([float(r[p]) for r in clients]) for p in ("mapped", "stale", "exact"))
        for clients in per_seed
    ]

    def share(idx: list[np.ndarray]) -> np.ndarray:
        got = np.mean(
            [(m[i] - s[i]).mean(-1) for (m, s, _), i in zip(arrays, idx, strict=True)], axis=0
        )
        lost = np.mean(
            [(e[i] - s[i]).mean(-1) for (_, s, e), i in zip(arrays, idx, strict=True)], axis=0
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(lost > 0, got / lost, np.nan)

    return interval(share, [len(c) for c in per_seed], batched=True)


def _judge(rows: list[dict[str, Any]], column: str) -> list[str]:
    """The issue's done-when, each called on its interval: met, missed or inconclusive."""
    words = ("met", "missed", "inconclusive")
    both = paired_bootstrap(_per_seed(rows, column, GAPS), "seen", "exact", "mapped", "mean")
    if both is None:
        return ["- not judged: a seed has fewer than 5 clients"]
    iv = {"effect": both["diff"], "low": both["low"], "high": both["high"]}
    out = [
        f"- mapped within 0.5 pp of exact, in mean over the gaps and seeds: "
        f"**{call(iv, TARGET_BEHIND_EXACT, above=False, words=words)}**: exact - mapped "
        f"{pp(iv)}"
    ]
    for gap in GAPS:
        per_seed = _per_seed(rows, column, (gap,))
        d = paired_bootstrap(per_seed, "seen", "mapped", "stale", "mean")
        if d is None:
            continue
        iv = {"effect": d["diff"], "low": d["low"], "high": d["high"]}
        verdict = "missed" if iv["high"] < 0 else "met"
        out.append(
            f"- {gap}: mapped never behind stale beyond its interval: **{verdict}**: "
            f"mapped - stale {pp(iv)}"
        )
        lost = paired_bootstrap(per_seed, "seen", "exact", "stale", "mean")
        if gap not in RECOVERY_GAPS or lost is None:
            continue
        lost_iv = {"effect": lost["diff"], "low": lost["low"], "high": lost["high"]}
        if lost_iv["low"] <= 0:
            out.append(
                f"- {gap}: recovers >= 80% of what stale keys lose: **inconclusive**: stale "
                f"keys lose nothing measurable (exact - stale {pp(lost_iv)})"
            )
            continue
        share = _recovered(per_seed)
        out.append(
            f"- {gap}: recovers >= 80% of what stale keys lose: "
            f"**{call(share, TARGET_RECOVERED, words=words)}**: "
            f"{pp(share, unit='%')} of exact - stale {pp(lost_iv)}"
        )
    return out


def _hurt(rows: list[dict[str, Any]], column: str) -> list[str]:
    """The share of clients each path leaves below another, per gap (a tie hurts no one)."""
    lines = [
        "| gap | " + " | ".join(f"{a} < {b}" for a, b in HURT_PAIRS) + " |",
        "|---|" + "---|" * len(HURT_PAIRS),
    ]
    for gap in GAPS:
        per_seed = _per_seed(rows, column, (gap,))
        cells = []
        for a, b in HURT_PAIRS:
            h = hurt_share(per_seed, "seen", a, b)
            cells.append(
                "-"
                if h is None
                else f"{100 * h['share']:.0f}% [{100 * h['low']:.0f}, {100 * h['high']:.0f}]"
            )
        lines.append(f"| {gap} | " + " | ".join(cells) + " |")
    return lines


def _word(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _knn_changes(rows: list[dict[str, Any]]) -> str:
    """Per gap, the seeds whose release runs another kNN setting than v1's."""
    names = ("k", "sigma", "normalize", "base")
    parts = []
    for gap in GAPS:
        pairs = sorted(
            {
                (r["seed"], tuple(r[f"v1_{n}"] for n in names), tuple(r[n] for n in names))
                for r in rows
                if r["gap"] == gap
            }
        )
        changed = [
            f"seed {seed} "
            + ", ".join(
                f"{n} {_word(a)} -> {_word(b)}"
                for n, a, b in zip(names, v1, new, strict=True)
                if a != b
            )
            for seed, v1, new in pairs
            if v1 != new
        ]
        parts.append(f"{gap}: " + ("; ".join(changed) if changed else "v1's in every seed"))
    return " | ".join(parts)


def _advice(rows: list[dict[str, Any]]) -> str:
    """What each gap's releases advised, counted over seeds."""
    parts = []
    for gap in GAPS:
        said = {(r["seed"], r["advice"]) for r in rows if r["gap"] == gap}
        counts = {a: sum(1 for _, b in said if b == a) for a in sorted({a for _, a in said})}
        parts.append(f"{gap}: " + ", ".join(f"{a!r} in {n} seed(s)" for a, n in counts.items()))
    return "; ".join(parts)


def summarise(rows: list[dict[str, Any]], out: Path, command: str) -> dict[str, Any]:
    """points.csv, clients.csv, summary.md and the plot from every client's row."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "clients.csv", csv_text(rows, list(rows[0])))
    points = []
    for key in sorted({(r["seed"], r["gap"], r["path"]) for r in rows}):
        mine = [r for r in rows if (r["seed"], r["gap"], r["path"]) == key]
        points.append(
            {
                "seed": key[0],
                "gap": key[1],
                "path": key[2],
                "mean_accuracy": float(np.mean([r["accuracy"] for r in mine])),
                "mean_knn_accuracy": float(np.mean([r["knn_accuracy"] for r in mine])),
                "mean_lam": float(np.mean([r["lam"] for r in mine])),
                "clients": len(mine),
                "mean_stored": float(np.mean([r["stored"] for r in mine])),
                "mean_fresh_stored": float(np.mean([r["fresh_stored"] for r in mine])),
            }
        )
    write_text_atomic(out / "points.csv", csv_text(points, list(points[0])))
    seeds = sorted({p["seed"] for p in points})
    stored = [p["mean_stored"] for p in points]
    fresh = [p["mean_fresh_stored"] for p in points]
    added = [r["added"] for r in rows]
    lines = [
        f"# Model update: accuracy after an upgrade, by path ({len(seeds)} seed(s): "
        f"{', '.join(map(str, seeds))})",
        "",
        "Accuracy on images from each device's shifted label distribution, mean over seen "
        "clients, then mean ± standard deviation across seeds. Verdicts: paired bootstrap 95% "
        "intervals, clients resampled within their seed. The device bundles held "
        f"{np.mean(stored):.0f} samples on average after adding {np.mean(added):.0f} (stale, "
        f"mapped and exact: the same ones); fresh bundles {np.mean(fresh):.0f}. The releases' "
        f"advice (mapped is the map applied regardless, `upgrade --force`): {_advice(rows)}. "
        "Each release chose its kNN setting on validation (the devices' v1 bundles run v1's k "
        "and sigma); stale keys are searched with the new release's k and sigma, so the "
        "datastore alone differs between stale and mapped in the keys only (the normalisation "
        "is in each encoder's graph: part of the space the keys live in; with lambda < 1, "
        "stale is mixed with the mapped bundle's base, a refitted linear head where the "
        "release chose one). The releases' settings against v1's: "
        f"{_knn_changes(rows)}.",
        "",
    ]
    tables = {}
    for column, title in (
        ("accuracy", "kNN-Per (each bundle's lambda)"),
        ("knn_accuracy", "the datastore alone (lambda 1)"),
    ):
        table = {}
        for gap in GAPS:
            for path in PATHS:
                means = [
                    p[f"mean_{column}"] for p in points if p["gap"] == gap and p["path"] == path
                ]
                if means:
                    std = float(np.std(means, ddof=1)) if len(means) > 1 else 0.0
                    table[(gap, path)] = (float(np.mean(means)), std)
        tables[column] = table
        lines += [
            f"## {title}",
            "",
            "| gap | " + " | ".join(PATHS) + " |",
            "|---|" + "---|" * len(PATHS),
        ]
        for gap in GAPS:
            cells = [
                f"{100 * table[(gap, p)][0]:.2f} ± {100 * table[(gap, p)][1]:.2f}"
                if (gap, p) in table
                else "-"
                for p in PATHS
            ]
            lines.append(f"| {gap} | " + " | ".join(cells) + " |")
        lines += ["", *_judge(rows, column), ""]
        lines += ["Clients hurt (share of clients below, [95% interval]):", ""]
        lines += [*_hurt(rows, column), ""]
    lines += [f"Command: `{command}`", ""]
    write_text_atomic(out / "summary.md", "\n".join(lines))
    _plot(tables, out / "model_update.png")
    return tables


def _plot(tables: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    width = 0.8 / len(PATHS)
    for ax, (column, title) in zip(
        axes, (("accuracy", "kNN-Per"), ("knn_accuracy", "datastore alone (lambda 1)")), strict=True
    ):
        table = tables[column]
        for i, p in enumerate(PATHS):
            means = [100 * table.get((g, p), (np.nan, 0))[0] for g in GAPS]
            errs = [100 * table.get((g, p), (0, 0))[1] for g in GAPS]
            ax.bar(np.arange(len(GAPS)) + i * width, means, width, yerr=errs, label=p)
        ax.set_xticks(np.arange(len(GAPS)) + 0.4 - width / 2, GAPS)
        ax.set_title(f"{title} after a model update, by path", fontsize=9)
    axes[0].set_ylabel("accuracy on the shifted stream (%)\n(bars: ± std across seeds)")
    axes[1].legend(fontsize=7, loc="lower right")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
