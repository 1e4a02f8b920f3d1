"""A bundle for a new device, unseen at training, built on the device from the global encoder,
the device's own labelled data and its memory budget; no server data is needed.

How the choice is made (kNN-Per's "new clients" setting):
1. Embed all the device's samples once with the encoder.
2. Hold out `val_fraction` of them (seeded) as a local validation split.
3. For each candidate recipe (default: flat fp32, fp16 and int8, each at the most stored samples
   that fit the budget next to the encoder, and at 1/2 and 1/4 of that), fit a datastore on the
   rest, take the best lambda of LAMBDA_GRID on the validation split, and score the candidate by
   its validation accuracy at that lambda. The best accuracy wins; ties (frequent on a few
   validation samples) go to the lower validation log-loss, then to the smaller footprint.
4. Refit the winning recipe on all the samples, validation ones included: on a device every
   labelled sample is worth keeping as memory, and lambda chosen with a smaller datastore is a
   slightly conservative (global-leaning) choice for the larger one.
The recipe records n = the candidate's budgeted capacity, so fifo updates may later fill it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .budget import Budget
from .bundle import BundleError, write_bundle
from .datastores import (
    BACKENDS,
    DEVICE_RECIPES,
    format_recipe,
    make_datastore,
    parse_recipe,
)
from .device_choice import InitSettings, choose_datastore, with_inputs
from .encoder import Encoder
from .head_file import no_sample_fits, samples_within
from .manifest import BundleFields, Manifest
from .preprocess import InputSpec, prepare_input, raw_checked
from .runtime import check_labels
from .versions import ModelVersion

logger = logging.getLogger(__name__)

_COUNT_FRACTIONS = (1.0, 0.5, 0.25)


@dataclass
class InitReport:
    """The chosen configuration and every candidate's validation score."""

    manifest: Manifest
    recipe: str
    lam: float
    val_accuracy: float | None
    candidates: list[dict] = field(default_factory=list)


def init_bundle(
    encoder_path: str | os.PathLike,
    x: np.ndarray,
    y: np.ndarray,
    budget_bytes: int,
    out_dir: str | os.PathLike,
    *,
    input_spec: InputSpec | Mapping[str, Any],
    settings: InitSettings | None = None,
    release: Manifest | None = None,
) -> InitReport:
    """Build and write a bundle for a new device (see the module docstring for the choice).
    Raises BundleError when even the encoder (or the encoder plus one stored sample) exceeds
    the budget.

    Parameters
    ----------
    encoder_path : the ONNX encoder (a server's export, e.g. its encoder.onnx).
    x, y : the device's labelled samples (inputs as `input_spec` describes, integer labels).
    budget_bytes : the device's total budget in bytes, encoder included.
    out_dir : the bundle's folder (written atomically, as `write_bundle`).
    input_spec : the encoder's input description (`preprocess.InputSpec`, or its JSON
        object; a bundle's manifest "input").
    settings : the kNN head, the candidates and their validation split, the manifest's fields
        (None: InitSettings' defaults).
    release : the validated manifest of a bundle of the release `encoder_path` comes from
        (`init --like`): the model version it records ("model", "replaces") is recorded in
        the new bundle too, so `info` and `upgrade` say which version the device runs.
        BundleError when that version's encoder is not `encoder_path`.

    Returns
    -------
    InitReport : the recipe chosen, lambda, and the candidates' validation scores.
    """
    s = InitSettings() if settings is None else settings
    try:
        input_spec = InputSpec.of(input_spec)
    except ValueError as exc:
        raise ValueError(f"input spec: {exc}") from None
    if not 0.0 <= s.val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {s.val_fraction}")
    budget = Budget(budget_bytes, Path(encoder_path).stat().st_size)
    if budget.room < 0:
        raise BundleError(
            f"the encoder alone takes {budget.encoder} bytes, over the budget of "
            f"{budget.total} bytes"
        )
    model = _release_version(release, encoder_path)
    z, logits, y = _embedded(encoder_path, x, y, input_spec, s.intra_op_threads)
    num_classes, dim = logits.shape[1], z.shape[1]
    inputs = raw_checked(x, input_spec) if s.keep_inputs else None
    recipes = s.recipes
    if inputs is not None:  # every candidate keeps them, and counts them in its footprint
        recipes = [with_inputs(r, inputs[0].nbytes) for r in (recipes or DEVICE_RECIPES)]
    candidates = _candidate_recipes(recipes, num_classes, dim, budget, z.shape[0], s)
    final, best, scored = choose_datastore(z, logits, y, candidates, s, inputs=inputs)
    fields = BundleFields(
        int(s.client_id),
        input_spec,
        float(best["lambda"]),
        budget.total,
        s.update_strategy,
        model=model,
    )
    manifest = write_bundle(out_dir, fields, encoder_path, final)
    return InitReport(manifest, best["recipe"], best["lambda"], best["val_accuracy"], scored)


def _embedded(
    encoder_path: str | os.PathLike,
    x: np.ndarray,
    y: np.ndarray,
    input_spec: InputSpec,
    intra_op_threads: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The device's samples through the encoder: embeddings, the global head's logits, and the
    labels checked against them."""
    xp = prepare_input(x, input_spec)
    if xp.shape[0] == 0:
        raise ValueError("init needs at least one labelled sample")
    z, logits = Encoder(encoder_path, intra_op_threads=intra_op_threads).run(xp)
    return z, logits, check_labels(y, z.shape[0], logits.shape[1])


def _release_version(
    release: Manifest | None, encoder_path: str | os.PathLike
) -> ModelVersion | None:
    """The model version (with its lineage) of `release` (a bundle's manifest) to record in
    the new bundle: none without one, or where it records none (a bundle from before
    versions)."""
    if release is None:
        return None
    version = release.model
    problem = version and version.encoder_problem(Path(encoder_path).read_bytes(), encoder_path)
    if problem:
        raise BundleError(
            f"{problem}: give the encoder of that release (its export's encoder.onnx), or a "
            "bundle of the encoder's own release"
        )
    return version


def _candidate_recipes(
    recipes: Sequence[str] | None,
    num_classes: int,
    dim: int,
    budget: Budget,
    n_all: int,
    settings: InitSettings,
) -> list[str]:
    """Recipe strings with n<count> that fit the budget's room by `samples_within` (the rule
    `add` and `upgrade` hold the bundle to); BundleError, one line, when none does."""
    out: list[str] = []
    seen: set = set()
    probes = []
    too_many: list[str] = []  # recipes whose own n is the problem, with the n that fits
    for recipe in recipes if recipes is not None else DEVICE_RECIPES:
        name, params = parse_recipe(recipe)
        if BACKENDS[name].TRAINED:
            raise ValueError(
                f"{name} datastores are trained on the server (they need torch); a device "
                "can only init "
                + " or ".join(b for b, cls in BACKENDS.items() if not cls.TRAINED)
                + " recipes"
            )
        probe = make_datastore(recipe, num_classes, settings.k, settings.sigma, seed=settings.seed)
        probes.append(probe)
        most = samples_within(probe, dim, budget)  # an init bundle refits no head
        if params.get("n") is not None:
            counts = [params["n"]] if params["n"] <= most else []
            if most >= 1 and not counts:
                too_many.append(
                    f"{recipe} asks for {params['n']} samples, the budget has room "
                    f"for {most} after the encoder: use "
                    f"{format_recipe(name, {**params, 'n': most})}, or leave n out"
                )
        else:
            counts = [int(most * f) for f in _COUNT_FRACTIONS if int(most * f) >= 1]
        for n in counts:
            # Counts at or above the device's sample count store the same samples: try the
            # largest (the most room for later fifo growth) once.
            same = (name, tuple(sorted(params.items() - {("n", params.get("n"))})), min(n, n_all))
            if same not in seen:
                seen.add(same)
                out.append(format_recipe(name, {**params, "n": n}))
    if not out:
        raise BundleError(too_many[0] if too_many else no_sample_fits(budget, probes, dim))
    return out
