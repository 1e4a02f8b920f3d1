"""The server half on Flower: a Strategy whose rounds are the simulation's rounds (the same
clients sampled with the same seeds, the same learning-rate schedule) and whose aggregation is the
algorithm's own `aggregate` (the paper's rule: clients that did not report count with the old
model), plus the federated evaluation of personalized models."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fed_train.algorithms.base import Algorithm, ClientResult, Weights
from fed_train.errors import KnnperError
from fed_train.evaluation import merge_results
from fed_train.flower.records import ModelSpec, check_shapes, to_array_record, to_weights
from fed_train.flower.settings import FlowerSettings
from fed_train.simulation import AGGREGATE_STREAM, client_seed, sample_clients

log = logging.getLogger(__name__)


class FederationError(KnnperError, RuntimeError):
    """A round or the federation as a whole cannot go on (too few replies, a client failed)."""


def reply_error(reply: Message) -> str:
    """A client's error in one line: Flower wraps the exception as "<class 'X'>:<'text'>"."""
    reason = reply.error.reason or f"error code {reply.error.code}"
    found = re.fullmatch(r"<class '[\w.]+'>:<'(.*)'>", reason, flags=re.S)
    return (found.group(1) if found else reason).strip().splitlines()[0]


class KnnperStrategy(Strategy):
    """`node_of` maps client id to the SuperNode that serves it; `num_train` the training
    samples of every training client (n_m), as the server's partition says."""

    def __init__(self, algorithm: Algorithm, settings: FlowerSettings, spec: ModelSpec,
                 node_of: dict[int, int], num_train: dict[int, int],
                 unseen: dict[int, bool]) -> None:
        self.algorithm, self.settings, self.spec = algorithm, settings, spec
        self.node_of, self.num_train, self.unseen = node_of, num_train, unseen
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
        log.info("%s on %d training clients (%d SuperNodes), %d rounds, participation %g",
                 self.algorithm.name, len(self.participants), len(self.node_of),
                 training.rounds, training.participation)

    def _message(self, node: int, kind: str, content: dict[str, Any], server_round: int
                 ) -> Message:
        return Message(RecordDict({**content, "model": self.spec.to_record()}), dst_node_id=node,
                       message_type=kind, group_id=str(server_round))

    def configure_train(self, server_round: int, arrays, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        r = server_round - 1
        training, seed = self.settings.run.training, self.settings.run.seed
        self._global = to_weights(arrays)
        lr = training.lr_at(r, training.rounds)
        picked = [self.participants[i] for i in sample_clients(seed, r, len(self.participants),
                                                               training.participation)]
        self._sampled = picked
        self._sent = {self.node_of[cid]: cid for cid in picked if cid not in self.lost}
        self.round_info = {"lr": lr, "sampled": len(picked),
                           "bytes_down": len(self._sent) * arrays.count_bytes()}
        return [self._message(node, MessageType.TRAIN,
                              {"arrays": arrays, "config": ConfigRecord(
                                  {**config, "lr": lr, "seed": client_seed(seed, r, cid),
                                   "round": server_round})}, server_round)
                for node, cid in self._sent.items()]

    def _train_result(self, cid: int, reply: Message) -> ClientResult:
        """A reply checked before it is aggregated: weight shapes and the sample count (n_m
        weighs the client's model, so it must be the partition's, not what a client claims)."""
        weights = to_weights(reply.content["arrays"])
        check_shapes(weights, self.model_weights, sender=f"client {cid}")
        metrics = reply.content["metrics"]
        reported = int(metrics["num-examples"])
        if reported != self.num_train[cid]:
            raise ValueError(f"it reports {reported} training samples, the partition gives it "
                             f"{self.num_train[cid]}")
        return ClientResult(weights, reported, dict(reply.content["state"]),
                            float(metrics["train-loss"]))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        results: dict[int, ClientResult] = {}
        failed: dict[int, str] = {}
        bytes_up = 0
        train_seconds: list[float] = []  # each client's own training, without Flower's cost
        for reply in replies:
            cid = self._sent.get(reply.metadata.src_node_id)
            if cid is None:
                continue
            if reply.has_error():
                failed[cid] = reply_error(reply)
                continue
            try:
                results[cid] = self._train_result(cid, reply)
            except (KeyError, TypeError, ValueError) as err:  # a client's fault: it is dropped
                failed[cid] = f"unusable reply: {err}"
                continue
            bytes_up += reply.content["arrays"].count_bytes()
            train_seconds.append(float(reply.content["metrics"].get("train-seconds", 0.0)))
        silent = sorted(set(self._sent.values()) - set(results) - set(failed))
        skipped = sorted(set(self._sampled) - set(self._sent.values()))
        self.lost.update(silent, failed)
        needed = min(self.settings.min_train_clients or len(self._sampled), len(self._sampled))
        problems = ([f"client {c}: {why}" for c, why in sorted(failed.items())]
                    + [f"client {c}: no reply within {self.settings.round_timeout:g} s"
                       for c in silent]
                    + [f"client {c}: lost in an earlier round" for c in skipped])
        if len(results) < needed:
            raise FederationError(f"round {server_round}: {len(results)} of "
                                  f"{len(self._sampled)} sampled clients answered, {needed} "
                                  f"needed ({'; '.join(problems)})")
        for problem in problems:
            log.warning("round %d goes on without %s", server_round, problem)
        ordered = [results[c] for c in sorted(results)]  # the simulation's order: by client id
        seed, r = self.settings.run.seed, server_round - 1
        new = self.algorithm.aggregate(self._global, ordered, self.total,
                                       client_seed(seed, r, 0, AGGREGATE_STREAM))
        loss = float(np.average([x.loss for x in ordered],
                                weights=[x.num_samples for x in ordered]))
        self.round_info.update(clients=len(ordered), train_loss=loss, bytes_up=bytes_up,
                               train_seconds=round(sum(train_seconds), 3),
                               train_seconds_max=round(max(train_seconds, default=0.0), 3))
        return to_array_record(new), MetricRecord({"train-loss": loss, "clients": len(ordered)})

    def configure_evaluate(self, server_round: int, arrays, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Every client still there, seen and unseen, personalizes and tests on its own node."""
        self._sent = {node: cid for cid, node in sorted(self.node_of.items())
                      if cid not in self.lost}
        return [self._message(node, MessageType.EVALUATE, {"arrays": arrays, "config": (
            ConfigRecord({**config, "unseen": self.unseen[cid]}))}, server_round)
            for node, cid in self._sent.items()]

    def configure_knn_phase(self, server_round: int, arrays,
                            config: ConfigRecord) -> Iterable[Message]:
        """Every seen client still there computes its share of a kNN-Per choice (a config
        "phase"; only sums over its validation split come back)."""
        self._sent = {node: cid for cid, node in sorted(self.node_of.items())
                      if cid not in self.lost and not self.unseen[cid]}
        return [self._message(node, MessageType.EVALUATE, {"arrays": arrays, "config": config},
                              server_round) for node in self._sent]

    def collect_knn_counts(self, replies: Iterable[Message]) -> dict[int, np.ndarray]:
        """Each answering client's counts; a client that failed is left out (with a warning),
        as in the evaluation: the choice is pooled over those that answered."""
        counts: dict[int, np.ndarray] = {}
        for reply in replies:
            cid = self._sent.get(reply.metadata.src_node_id)
            if cid is None:
                continue
            try:
                if reply.has_error():
                    raise ValueError(reply_error(reply))
                array = np.asarray(json.loads(str(reply.content["counts"]["counts"])),
                                   dtype=np.float64)
                if array.ndim != 2 or not np.isfinite(array).all() or (array < 0).any():
                    raise ValueError(f"counts of shape {array.shape} are not usable")
            except (KeyError, TypeError, ValueError) as err:
                log.warning("kNN-Per choice without client %d: %s", cid, err)
                continue
            counts[cid] = array
        return dict(sorted(counts.items()))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord:
        """The summary `knnper evaluate` prints (mean weighted by test size, bottom decile, for
        seen and unseen clients); the per-client rows are kept in `self.evaluation`."""
        per_method: dict[str, list[dict[str, Any]]] = {}
        failed = []
        for reply in replies:
            cid = self._sent.get(reply.metadata.src_node_id)
            if cid is None:
                continue
            if reply.has_error():
                failed.append(f"client {cid}: {reply_error(reply)}")
                continue
            try:
                rows = {m: json.loads(str(row)) for m, row in reply.content["rows"].items()}
            except (KeyError, TypeError, ValueError) as err:
                failed.append(f"client {cid}: unusable reply: {err}")
                continue
            for method, row in rows.items():
                per_method.setdefault(method, []).append({**row, "client_id": cid})
        answered = {r["client_id"] for rows in per_method.values() for r in rows}
        missing = sorted(set(self.node_of) - answered)
        if failed or missing:
            log.warning("evaluation without clients %s (%s)", missing, "; ".join(failed))
        for rows in per_method.values():
            rows.sort(key=lambda r: r["client_id"])
        self.evaluation = merge_results(per_method)
        self.evaluation["missing_clients"] = missing
        summary = {}
        for group in ("seen", "unseen"):
            for method, s in self.evaluation[group].items():
                summary[f"{group}-{method}-mean"] = s["mean"]
                summary[f"{group}-{method}-bottom-decile"] = s["bottom_decile"]
        return MetricRecord(summary)
