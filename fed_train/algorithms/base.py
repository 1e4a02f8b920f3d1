"""What every federated algorithm shares: the client's data, local SGD, weights as plain arrays,
and the paper's aggregation rule. An algorithm is a client half (`client_update`), a server half
(`aggregate`) and a personalization step; the simulation loop knows nothing else about it.
`FederatedAlgorithm` holds what the federated ones write alike."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from fed_train.accelerator import autocast
from fed_train.errors import TrainingDiverged
from fed_train.models import EmbedHeadModel, ModelFactory
from fed_train.training_config import TrainingConfig

Weights = dict[str, np.ndarray]
# what a client keeps between its rounds (personal models, its cluster): plain data only
ClientState = dict[str, Any]


_SPLITS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


@dataclass
class ClientData:
    """One client's prepared tensors (model inputs) and labels for each split.

    Parameters
    ----------
    client_id : the client's index in its partition.
    x_train, x_val, x_test : each split's model-ready inputs.
    y_train, y_val, y_test : each split's int64 labels.
    unseen : whether the client is held out of training.
    """

    client_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    unseen: bool = False

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def to(self, device: torch.device) -> ClientData:
        """This client's tensors on `device`, moved once per run rather than once per batch (the
        same object on the CPU, so the CPU path copies nothing)."""
        if all(t.device == device for t in (self.x_train, self.y_train)):
            return self
        return replace(self, **{name: getattr(self, name).to(device) for name in _SPLITS})


@dataclass
class ClientResult:
    """What a client reports to the server after a round: plain data only."""

    weights: Weights
    num_samples: int
    state: ClientState = field(default_factory=dict)
    loss: float = float("nan")


@dataclass
class PersonalModel:
    """A client's final predictor plus what was chosen for it (lambda, cluster, ...), kept in the
    per-client results so others can see why a client scored what it did."""

    predict_proba: Callable[[torch.Tensor], np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)


class Algorithm(Protocol):
    """The three halves of a federated method (Flower's split, plus how clients personalize),
    and what the tables and command lines read of it: its row title, the method whose training
    run it personalizes instead of training its own (None: its own), and the rough cost of its
    training in FedAvg-equivalents (to start the longest jobs first)."""

    name: str
    title: str
    federated: bool
    trained_by: str | None
    job_cost: float

    def client_update(
        self, global_weights: Weights, client: ClientData, state: ClientState, lr: float, seed: int
    ) -> ClientResult: ...

    def aggregate(
        self, global_weights: Weights, results: list[ClientResult], total_samples: int, seed: int
    ) -> Weights: ...

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel: ...


def get_weights(model: nn.Module) -> Weights:
    return {name: t.detach().cpu().numpy().copy() for name, t in model.state_dict().items()}


def set_weights(model: nn.Module, weights: Weights) -> None:
    model.load_state_dict({name: torch.from_numpy(np.asarray(w)) for name, w in weights.items()})


def aggregate_weights(
    global_weights: Weights, updates: list[tuple[Weights, int]], total_samples: int
) -> Weights:
    """w_{t+1} = sum_{m not sampled} (n_m/n) w_t + sum_{m sampled} (n_m/n) w_t^m.

    Clients that were not sampled contribute the current global weights, so with partial
    participation the step shrinks instead of over-weighting the few clients that reported.
    """
    if total_samples <= 0:
        raise ValueError("total_samples must be positive")
    reported = sum(n for _, n in updates)
    if reported > total_samples:
        raise ValueError(
            f"clients reported {reported} samples, more than the total {total_samples}"
        )
    out: Weights = {}
    for name, w in global_weights.items():
        acc = (1.0 - reported / total_samples) * w.astype(np.float64)
        for weights, n in updates:
            acc += (n / total_samples) * weights[name].astype(np.float64)
        out[name] = (
            acc.astype(w.dtype)
            if np.issubdtype(w.dtype, np.floating)
            else np.rint(acc).astype(w.dtype)
        )
    return out


def sub_seed(seed: int, *keys: int) -> int:
    """An independent stream for one part of a run (a round's client, a personal model, an
    epoch): the same keys always give the same stream, other keys an unrelated one."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterable[np.ndarray]:
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def batch_schedule(
    n: int, training: TrainingConfig, seed: int, epochs: int | None = None
) -> Iterator[np.ndarray]:
    """The mini-batch indices `local_sgd` steps through for this seed: `training.steps` of them
    when set, else `epochs` (default `training.epochs`) passes over a fresh permutation each.
    Methods that step on their own (APFL, clients stepped together) draw the same batches, so a
    method that reduces to FedAvg (APFL with alpha = 0) reproduces it bit for bit."""
    if n == 0:
        return
    rng = np.random.default_rng(seed)
    if training.steps is not None:
        epochs_needed = math.ceil(training.steps / math.ceil(n / training.batch_size))
        budget: int | None = training.steps
    else:
        epochs_needed = epochs if epochs is not None else training.epochs
        budget = None
    steps = 0
    for _ in range(epochs_needed):
        for idx in batches(n, training.batch_size, rng):
            if budget is not None and steps >= budget:
                return
            yield idx
            steps += 1


def on_device(schedule: Iterable[np.ndarray], device: torch.device) -> Iterator[torch.Tensor]:
    """A schedule's index arrays as slices of one tensor copied to `device` once: a copy from
    host memory on every step would make the host wait for the device on every step."""
    parts = list(schedule)
    if not parts:
        return
    flat = torch.from_numpy(np.concatenate(parts)).to(device)
    start = 0
    for part in parts:
        yield flat[start : start + len(part)]
        start += len(part)


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def make_optimizer(
    params: Iterable[nn.Parameter], training: TrainingConfig, lr: float
) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        list(params), lr=lr, momentum=training.momentum, weight_decay=training.weight_decay
    )


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: TrainingConfig,
    lr: float,
    seed: int,
    *,
    epochs: int | None = None,
    params: Iterable[nn.Parameter] | None = None,
    loss_fn: LossFn = cross_entropy,
    after_step: Callable[[], None] | None = None,
) -> float:
    """SGD over the client's data in `batch_schedule`'s order; returns the mean loss (NaN when
    there is no data). Every method's local training is this loop, with hooks for what differs:
    `params`, the parameters that train (FedRep's body; default all); `loss_fn`, the loss of a
    batch (pFedGP's predictive loss; default cross-entropy); `after_step`, run after each
    optimiser step (Ditto's proximal step). A NaN or infinite loss stops the run
    (`finite_mean_loss`) instead of averaging NaN weights into the global model."""
    trainable = list(params) if params is not None else list(model.parameters())
    opt = make_optimizer(trainable, training, lr)
    model.train()
    # the loss is summed where it is computed and checked once at the end: a per-step check
    # would wait for an accelerator on every step; a NaN still never reaches the aggregate
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    count = 0
    for index in on_device(batch_schedule(int(y.shape[0]), training, seed, epochs), x.device):
        opt.zero_grad()
        with autocast(x.device, training.precision):
            loss = loss_fn(model, x[index], y[index])
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        total += loss.detach().double() * len(index)
        count += len(index)
    return finite_mean_loss(total, count, lr)


def finite_mean_loss(total: torch.Tensor, count: int, lr: float) -> float:
    """The mean training loss over `count` samples (NaN when there were none), or
    TrainingDiverged when a step's loss was NaN or infinite (it would average NaN weights into
    the global model)."""
    if count == 0:
        return float("nan")
    mean = float(total) / count
    if not math.isfinite(mean):
        raise TrainingDiverged(
            f"the training loss became {mean} (lr={lr:g}); lower the learning rate"
        )
    return mean


@torch.no_grad()
def predict_proba(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> np.ndarray:
    model.eval()
    out = [torch.softmax(model(x[i : i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]
    return torch.cat(out).double().cpu().numpy() if out else np.zeros((0, 0))


@torch.no_grad()
def embed_and_logits(
    model: EmbedHeadModel, x: torch.Tensor, batch_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    model.eval()
    zs, logits = [], []
    for i in range(0, len(x), batch_size):
        z = model.embed(x[i : i + batch_size])
        zs.append(z)
        logits.append(model.head(z))
    if not zs:
        return np.zeros((0, model.embedding_dim), np.float32), np.zeros((0, 0), np.float32)
    return torch.cat(zs).cpu().numpy(), torch.cat(logits).cpu().numpy()


def model_predictor(model: nn.Module) -> Callable[[torch.Tensor], np.ndarray]:
    return lambda x: predict_proba(model, x)


class FederatedAlgorithm:
    """The common half of the federated methods: one working model that every client update
    reuses (one model's memory, not one per client), trained from given weights by `train_from`;
    the paper's aggregation over every weight; fresh models to predict with (`model_with`). A
    method overrides what differs: its loss (`batch_loss`: pFedGP), where an update starts and
    what the client keeps (`client_update`: ClusteredFL, Ditto), what is averaged (`aggregate`:
    FedRep, ClusteredFL). Those whose clients can also step together build on
    `stepped.SteppedAlgorithm`."""

    name: str
    title: str
    federated = True
    trained_by: str | None = None
    job_cost = 1.0

    def __init__(self, model_fn: ModelFactory, training: TrainingConfig) -> None:
        self.model_fn = model_fn
        self.training = training
        self._work = model_fn()
        self.param_names = [name for name, _ in self._work.named_parameters()]

    def batch_loss(self, seed: int) -> LossFn:
        """The loss `local_sgd` steps on in the client update seeded `seed`."""
        return cross_entropy

    def train_from(
        self, weights: Weights, client: ClientData, lr: float, seed: int
    ) -> tuple[Weights, float]:
        """The working model trained on the client's data from `weights`: its weights and the
        mean loss (`local_sgd`)."""
        set_weights(self._work, weights)
        loss = local_sgd(
            self._work,
            client.x_train,
            client.y_train,
            self.training,
            lr,
            seed,
            loss_fn=self.batch_loss(seed),
        )
        return get_weights(self._work), loss

    def client_update(
        self, global_weights: Weights, client: ClientData, state: ClientState, lr: float, seed: int
    ) -> ClientResult:
        weights, loss = self.train_from(global_weights, client, lr, seed)
        return ClientResult(weights, client.num_train, state, loss)

    def aggregate(
        self, global_weights: Weights, results: list[ClientResult], total_samples: int, seed: int
    ) -> Weights:
        return aggregate_weights(
            global_weights, [(r.weights, r.num_samples) for r in results], total_samples
        )

    def check_result(self, global_weights: Weights, client_id: int, result: ClientResult) -> None:
        """Refuse (ValueError) what this method's `client_update` for `client_id` could not
        have sent from `global_weights`, before a server aggregates a remote client's reply.
        The weights' shapes and the sample count are the receiver's to check; a method whose
        server reads the client's `state` checks it here (none does but ClusteredFL)."""

    def model_with(self, weights: Weights) -> EmbedHeadModel:
        """A fresh model holding `weights`, in eval mode."""
        model = self.model_fn()
        set_weights(model, weights)
        model.eval()
        return model
