"""The server half on Flower: a Strategy whose rounds are the simulation's rounds (the same
clients sampled with the same seeds, the same learning-rate schedule) and whose aggregation is the
algorithm's own `aggregate` (the paper's rule: clients that did not report count with the old
model), plus the federated evaluation of personalized models."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edge_runtime.arg_types import FLOAT32_MAX
from edge_runtime.errors import one_line
from fed_train.algorithms.base import ClientResult, FederatedAlgorithm, Weights
from fed_train.errors import KnnperError
from fed_train.evaluation import merge_results
from fed_train.flower.records import (
    ModelSpec,
    check_shapes,
    from_config_record,
    read_counts,
    to_array_record,
    to_weights,
)
from fed_train.flower.settings import FlowerSettings
from fed_train.simulation import AGGREGATE_STREAM, client_seed, sample_clients

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_CHOICES = 32  # what one personalization says it chose (lambda, cluster, ...): a handful
MAX_NAME = 100  # characters of a chosen value that is a name


class FederationError(KnnperError, RuntimeError):
    """A round or the federation as a whole cannot go on (too few replies, a client failed)."""


def reply_error(reply: Message) -> str:
    """A client's error in one line: Flower wraps the exception as "<class 'X'>:<'text'>"."""
    reason = reply.error.reason or f"error code {reply.error.code}"
    found = re.fullmatch(r"<class '[\w.]+'>:<'(.*)'>", reason, flags=re.S)
    return (found.group(1) if found else reason).strip().splitlines()[0]


@dataclass(frozen=True)
class Replies(Generic[T]):
    """What the clients a phase asked sent back: each usable reply's content by client id, why
    each failed client is left out (one line), and who did not answer in time."""

    read: dict[int, T]
    failed: dict[int, str]
    silent: list[int]


def read_replies(
    replies: Iterable[Message], sent: dict[int, int], read: Callable[[int, Message], T]
) -> Replies[T]:
    """Every phase's reply check. `sent` maps each asked node to the id its reply is filed
    under (a client id; the node's own before clients are known); other replies are ignored.
    An error reply leaves its sender out with Flower's reason; `read` takes what a reply
    carries and raises KeyError, TypeError or ValueError on content it cannot use, which
    leaves that sender out too: a client's fault never stops the server by itself."""
    read_ok: dict[int, T] = {}
    failed: dict[int, str] = {}
    for reply in replies:
        key = sent.get(reply.metadata.src_node_id)
        if key is None:
            continue
        if reply.has_error():
            failed[key] = reply_error(reply)
            continue
        try:
            read_ok[key] = read(key, reply)
        except (KeyError, TypeError, ValueError) as err:
            failed[key] = f"unusable reply: {one_line(err, first_line=True)}"
    silent = sorted(set(sent.values()) - set(read_ok) - set(failed))
    return Replies(dict(sorted(read_ok.items())), dict(sorted(failed.items())), silent)


def _checked_choices(method: str, chosen: Any) -> dict[str, Any]:
    """What a client's personalization chose, as the evaluation JSON writes it: a few flat
    scalars (None, flags, finite numbers, short names)."""
    if not isinstance(chosen, dict) or len(chosen) > MAX_CHOICES:
        raise ValueError(f"{method}'s choices are not at most {MAX_CHOICES} named values")
    for key, value in chosen.items():
        if not (
            value is None
            or isinstance(value, bool | int)
            or (isinstance(value, float) and math.isfinite(value))
            or (isinstance(value, str) and len(value) <= MAX_NAME)
        ):
            raise ValueError(
                f"{method}'s choice {key!r} is {value!r:.40}, not a finite number, "
                "a flag or a short name"
            )
    return chosen


class KnnperStrategy(Strategy):
    """`node_of` maps client id to the SuperNode that serves it; `num_train` the training
    samples of every training client (n_m), `num_test` every client's test samples, as the
    server's partition says (a reply's counts weigh means, so they must be these)."""

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        settings: FlowerSettings,
        spec: ModelSpec,
        node_of: dict[int, int],
        num_train: dict[int, int],
        unseen: dict[int, bool],
        num_test: dict[int, int] | None = None,
    ) -> None:
        self.algorithm, self.settings, self.spec = algorithm, settings, spec
        self.node_of, self.num_train, self.unseen = node_of, num_train, unseen
        self.num_test = num_test
        self.participants = sorted(num_train)
        self.total = sum(num_train.values())
        self.model_weights = spec.shapes()
        self.evaluation: dict[str, Any] | None = None
        self.round_info: dict[str, Any] = {}
        self.lost: set[int] = set()  # clients that failed or missed a deadline: not asked again
        self._global: Weights = {}
        self._sampled: list[int] = []
        self._sent: dict[int, int] = {}

    def summary(self) -> None:
        training = self.settings.run.training
        log.info(
            "%s on %d training clients (%d SuperNodes), %d rounds, participation %g",
            self.algorithm.name,
            len(self.participants),
            len(self.node_of),
            training.rounds,
            training.participation,
        )

    def _message(self, node: int, kind: str, content: dict[str, Any], server_round: int) -> Message:
        return Message(
            RecordDict({**content, "model": self.spec.to_record()}),
            dst_node_id=node,
            message_type=kind,
            group_id=str(server_round),
        )

    def configure_train(
        self, server_round: int, arrays, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        r = server_round - 1
        training, seed = self.settings.run.training, self.settings.run.seed
        self._global = to_weights(arrays)
        lr = training.lr_at(r, training.rounds)
        picked = [
            self.participants[i]
            for i in sample_clients(seed, r, len(self.participants), training.participation)
        ]
        self._sampled = picked
        self._sent = {self.node_of[cid]: cid for cid in picked if cid not in self.lost}
        self.round_info = {
            "lr": lr,
            "sampled": len(picked),
            "bytes_down": len(self._sent) * arrays.count_bytes(),
        }
        return [
            self._message(
                node,
                MessageType.TRAIN,
                {
                    "arrays": arrays,
                    "config": ConfigRecord(
                        {
                            **config,
                            "lr": lr,
                            "seed": client_seed(seed, r, cid),
                            "round": server_round,
                        }
                    ),
                },
                server_round,
            )
            for node, cid in self._sent.items()
        ]

    def _train_result(self, cid: int, reply: Message) -> tuple[ClientResult, int, float]:
        """A reply checked before it is aggregated: weight shapes and the sample count (n_m
        weighs the client's model, so it must be the partition's, not what a client claims).
        With the bytes it sent and the seconds its training took, without Flower's cost."""
        arrays = reply.content.array_records["arrays"]
        weights = to_weights(arrays)
        check_shapes(weights, self.model_weights, sender=f"client {cid}")
        # a NaN, or values so large that averaging overflows (3e38), would be aggregated and
        # fail every client of the next round
        bound = FLOAT32_MAX / max(1, self.total)
        for name, w in weights.items():
            if not np.all(np.abs(np.asarray(w, dtype=np.float64)) <= bound):
                raise ValueError(
                    f"its weights {name!r} are not finite or past {bound:.3g} "
                    "(averaging them would overflow)"
                )
        metrics = reply.content.metric_records["metrics"]
        reported = int(metrics["num-examples"])
        if reported != self.num_train[cid]:
            raise ValueError(
                f"it reports {reported} training samples, the partition gives it "
                f"{self.num_train[cid]}"
            )
        seconds = float(metrics.get("train-seconds", 0.0))
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"it reports {seconds} s of training")
        loss = float(metrics["train-loss"])
        if not (math.isfinite(loss) and loss >= 0):  # metrics.jsonl keeps it; resume reads it
            raise ValueError(f"it reports a training loss of {loss}")
        result = ClientResult(
            weights, reported, from_config_record(reply.content.config_records["state"]), loss
        )
        self.algorithm.check_result(self._global, cid, result)
        return result, arrays.count_bytes(), seconds

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        got = read_replies(replies, self._sent, self._train_result)
        skipped = sorted(set(self._sampled) - set(self._sent.values()))
        self.lost.update(got.silent, got.failed)
        needed = min(self.settings.min_train_clients or len(self._sampled), len(self._sampled))
        problems = (
            [f"client {c}: {why}" for c, why in got.failed.items()]
            + [f"client {c}: no reply within {self.settings.round_timeout:g} s" for c in got.silent]
            + [f"client {c}: lost in an earlier round" for c in skipped]
        )
        if len(got.read) < needed:
            raise FederationError(
                f"round {server_round}: {len(got.read)} of "
                f"{len(self._sampled)} sampled clients answered, {needed} "
                f"needed ({'; '.join(problems)})"
            )
        for problem in problems:
            log.warning("round %d goes on without %s", server_round, problem)
        # the simulation's order: by client id
        ordered = [result for result, _, _ in got.read.values()]
        bytes_up = sum(sent for _, sent, _ in got.read.values())
        train_seconds = [seconds for _, _, seconds in got.read.values()]
        seed, r = self.settings.run.seed, server_round - 1
        new = self.algorithm.aggregate(
            self._global, ordered, self.total, client_seed(seed, r, 0, AGGREGATE_STREAM)
        )
        loss = float(
            np.average([x.loss for x in ordered], weights=[x.num_samples for x in ordered])
        )
        self.round_info.update(
            clients=len(ordered),
            train_loss=loss,
            bytes_up=bytes_up,
            train_seconds=round(sum(train_seconds), 3),
            train_seconds_max=round(max(train_seconds, default=0.0), 3),
        )
        return to_array_record(new), MetricRecord({"train-loss": loss, "clients": len(ordered)})

    def configure_evaluate(
        self, server_round: int, arrays, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Every client still there, seen and unseen, personalizes and tests on its own node."""
        self._sent = {
            node: cid for cid, node in sorted(self.node_of.items()) if cid not in self.lost
        }
        return [
            self._message(
                node,
                MessageType.EVALUATE,
                {
                    "arrays": arrays,
                    "config": (ConfigRecord({**config, "unseen": self.unseen[cid]})),
                },
                server_round,
            )
            for node, cid in self._sent.items()
        ]

    def configure_knn_phase(
        self, server_round: int, arrays, config: ConfigRecord, points: ConfigRecord
    ) -> Iterable[Message]:
        """Every seen client still there computes its share of a kNN-Per choice (a config
        "phase", under kNN-Per's grid `points`; only sums over its validation split come
        back)."""
        self._sent = {
            node: cid
            for cid, node in sorted(self.node_of.items())
            if cid not in self.lost and not self.unseen[cid]
        }
        return [
            self._message(
                node,
                MessageType.EVALUATE,
                {"arrays": arrays, "config": config, "points": points},
                server_round,
            )
            for node in self._sent
        ]

    def collect_knn_counts(
        self, replies: Iterable[Message], phase: str, shape: tuple[int, ...]
    ) -> dict[int, np.ndarray]:
        """Each answering client's sums for `phase`, each of `shape`; a client that failed is
        left out (with a warning), as in the evaluation: the choice is pooled over those that
        answered."""
        got = read_replies(
            replies,
            self._sent,
            lambda cid, reply: read_counts(reply.content.array_records["counts"], phase, shape),
        )
        for cid, why in got.failed.items():
            log.warning("kNN-Per choice without client %d: %s", cid, why)
        for cid in got.silent:
            log.warning(
                "kNN-Per choice without client %d: no reply within %g s",
                cid,
                self.settings.round_timeout,
            )
        return got.read

    def _evaluation_rows(self, cid: int, reply: Message) -> dict[str, dict[str, Any]]:
        """The client's row for each evaluated method, as `client_accuracies` makes it, from
        its test size and accuracies (a MetricRecord; no accuracy without test samples) and
        what its personalizations chose (a ConfigRecord, one "method/name" per value)."""
        metrics = reply.content.metric_records["metrics"]
        chosen = from_config_record(reply.content.config_records["info"])
        n_test = metrics["num-examples"]
        if not isinstance(n_test, int) or n_test < 0:
            raise ValueError(f"it reports {n_test!r:.40} test samples")
        if self.num_test is not None and n_test != self.num_test[cid]:
            raise ValueError(
                f"it reports {n_test} test samples, the partition gives it {self.num_test[cid]}"
            )
        methods = list(dict.fromkeys(self.settings.eval_methods))
        unasked = sorted(set(chosen) - set(methods))
        if unasked:
            raise ValueError(f"it reports choices of methods not evaluated: {unasked[:3]}")
        rows = {}
        for method in methods:
            accuracy = metrics.get(f"{method}-accuracy")
            if accuracy is not None and not (
                isinstance(accuracy, float) and 0.0 <= accuracy <= 1.0
            ):
                raise ValueError(f"its {method} accuracy {accuracy!r:.40} is not in [0, 1]")
            rows[method] = {
                "client_id": cid,
                "unseen": self.unseen[cid],
                "n_test": n_test,
                "accuracy": accuracy,
                "info": _checked_choices(method, chosen.get(method, {})),
            }
        return rows

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord:
        """The summary `knnper evaluate` prints (mean weighted by test size, bottom decile, for
        seen and unseen clients); the per-client rows are kept in `self.evaluation`."""
        got = read_replies(replies, self._sent, self._evaluation_rows)
        per_method: dict[str, list[dict[str, Any]]] = {}
        for rows in got.read.values():  # by client id
            for method, row in rows.items():
                per_method.setdefault(method, []).append(row)
        missing = sorted(set(self.node_of) - set(got.read))
        if missing:
            log.warning(
                "evaluation without clients %s (%s)",
                missing,
                "; ".join(f"client {c}: {why}" for c, why in got.failed.items()),
            )
        self.evaluation = merge_results(per_method)
        self.evaluation["missing_clients"] = missing
        summary = {}
        for group in ("seen", "unseen"):
            for method, s in self.evaluation[group].items():
                summary[f"{group}-{method}-mean"] = s["mean"]
                summary[f"{group}-{method}-bottom-decile"] = s["bottom_decile"]
        return MetricRecord(summary)
