"""kNN-Per's setting as one value: a point of its grid (`KNNConfig`) and the whole configuration
a model's devices run (`KNNChoice`), checked when it is built, and the personal head it runs.

Every place that personalizes with a setting builds its head here (`KNNChoice.head`): the
server's kNN-Per, the tuning grid, the experiments, the exporter's sizer and its clients' linear
heads. Where they differ they say how, by name: the embeddings they pass are already
normalised, or the base they pass already holds the client's linear head. How a choice is made
and saved with its evidence is fed_train.knn_choice's; this module imports nothing of the
training side, so an algorithm can hold a choice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from edge_runtime.knn import (
    CLIENT_RULE,
    DEFAULT_K,
    DEFAULT_NORMALIZE,
    DEFAULT_SIGMA,
    LambdaRule,
    base_problem,
)
from edge_runtime.personal_head import PersonalHead, check_settings


@dataclass(frozen=True)
class KNNConfig:
    """One point of kNN-Per's grid; the defaults are the paper's (k = 10, sigma = 1, raw)."""

    k: int = DEFAULT_K
    sigma: float = DEFAULT_SIGMA
    normalize: str = DEFAULT_NORMALIZE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KNNChoice:
    """The configuration a model's devices run, where each value came from, and the evidence.
    One built in code, with no sources (the paper's setting by default), runs the same but is
    recorded nowhere: it has no provenance. Built only if a device can run it (ValueError, one
    line, otherwise): k and sigma in range, a known normalisation and lambda estimator, a
    `LambdaRule`, and the base "global" without an l2 or "linear" with a positive one."""

    config: KNNConfig = KNNConfig()
    lambda_estimator: str = "val"
    source: dict[str, str] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict, repr=False)
    lambda_rule: LambdaRule = CLIENT_RULE
    base: str = "global"  # what the kNN is interpolated with: the global model or a linear head
    l2: float | None = None  # the linear head's regularisation, with the linear base

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise ValueError(f"kNN-Per setting: {problem}")

    def head(
        self,
        num_classes: int,
        *,
        normalized: bool = False,
        linear_in_logits: bool = False,
        rule: LambdaRule | None = None,
    ) -> PersonalHead:
        """The unfitted personal head this setting runs for `num_classes` classes.

        normalized : the embeddings the head will see are already normalised as this setting
            says (an exported encoder normalises inside its graph; `client_views` normalises
            the server's), so it does not normalise them again.
        linear_in_logits : the base outputs the head will be given are already the client's
            linear head's (its own encoder's logits, what the exporter's sizer scores), so it
            fits none of its own.
        rule : a lambda rule in place of the chosen one (the experiments and the tuning grid
            choose each client's own lambda first and fit the pooled rule over them after).
        """
        return PersonalHead(
            num_classes,
            k=self.config.k,
            sigma=self.config.sigma,
            normalize=DEFAULT_NORMALIZE if normalized else self.config.normalize,
            l2=None if linear_in_logits else self.l2,
            rule=self.lambda_rule if rule is None else rule,
            estimator=self.lambda_estimator,
        )

    def provenance(self) -> dict[str, dict[str, Any]] | None:
        """Each value with where it came from: what manifests and export.json record (None
        without sources)."""
        if not self.source:
            return None
        values = {
            **self.config.to_dict(),
            "lambda_estimator": self.lambda_estimator,
            "lambda_rule": self.lambda_rule.name,
            "base": self.base,
        }
        sources = dict(self.source)
        if self.base == "linear":  # what a device refits its head with after `add`
            values["l2"] = self.l2
            sources.setdefault("l2", sources["base"])
        return {name: {"value": values[name], "source": sources[name]} for name in values}

    def describe(self) -> str:
        return describe_record(self.record)


def _problem(choice: KNNChoice) -> str | None:
    """Why `choice` cannot run on a device, or None (the checks PersonalHead and the saved
    records share)."""
    if not isinstance(choice.config, KNNConfig):
        return f"config must be a KNNConfig, got {choice.config!r}"
    if not isinstance(choice.lambda_rule, LambdaRule):
        return f"lambda_rule must be a LambdaRule, got {choice.lambda_rule!r}"
    problem = base_problem(choice.base, choice.l2)
    if problem is not None:
        return problem
    c = choice.config
    try:
        check_settings(c.k, c.sigma, c.normalize, choice.lambda_estimator, choice.l2)
    except ValueError as err:
        return str(err)
    return None


def describe_record(record: dict[str, Any]) -> str:
    """One line: the values and where each came from."""
    c, source = record["config"], record["source"]
    return (
        f"kNN-Per: k={c['k']} ({source['k']}), sigma={c['sigma']:g} ({source['sigma']}), "
        f"embeddings {c['normalize']} ({source['normalize']}), lambda by "
        f"{record['estimator']} ({source['lambda_estimator']}), lambda rule "
        f"{record['lambda_rule']['name']} ({source['lambda_rule']}), interpolated with the "
        f"{_base_words(record['base'])} ({source['base']})"
    )


def _base_words(base: dict[str, Any]) -> str:
    if base["name"] == "linear":
        return f"clients' linear heads (l2={base['l2']:g})"
    return "global model"
