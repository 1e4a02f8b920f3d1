"""FedRep (Collins et al. 2021): a shared body (the model's `embed`) learned federatedly and a
personal linear head per client that never leaves it.

- A participating client loads the global body and its own head (the initial global head the
  first time), trains the head for `head_epochs` with the body frozen, then the body for the
  round's local epochs with the head frozen, as in the paper (10 head epochs by default).
- Only body weights are sent and averaged (the paper's rule); the global head entries keep
  their initial values and serve only to initialise new heads.
- Heads live in the client state as {"head": weights}.
- With the body frozen, head epochs run on embeddings computed once in eval mode: identical to
  running the full network for models without batch-norm or dropout (the small CNN, the LSTM),
  and for MobileNet-v2 it uses running batch-norm statistics instead of batch ones.
- At personalization the head is refreshed on the final body (the head step a client would take
  at the start of its next round), then the client predicts with body + own head. Unseen clients
  train a head from the initial one on the frozen body for as many head epochs as a seen client
  gets over the run (head_epochs x expected participations), cheap on cached embeddings.
"""

from __future__ import annotations

import torch

from fed_train.algorithms.base import (
    ClientData,
    ClientResult,
    ClientState,
    PersonalModel,
    Weights,
    aggregate_weights,
    batch_schedule,
    embed_and_logits,
    get_weights,
    local_sgd,
    model_predictor,
    set_weights,
    sub_seed,
)
from fed_train.algorithms.personal import epochs_only
from fed_train.algorithms.stepped import Cohort, SteppedAlgorithm
from fed_train.algorithms.stepping import Lane, cross_entropy_loss
from fed_train.models import EmbedHeadModel, ModelFactory
from fed_train.training_config import TrainingConfig


class FedRep(SteppedAlgorithm):
    name = "fedrep"
    title = "FedRep"
    job_cost = 1.5

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        head_epochs: int = 10,
        unseen_head_epochs: int | None = None,
        head_lr: float | None = None,
    ) -> None:
        if head_epochs < 0:
            raise ValueError(f"head_epochs must be >= 0, got {head_epochs}")
        if unseen_head_epochs is not None and unseen_head_epochs < 0:
            raise ValueError(f"unseen_head_epochs must be >= 0, got {unseen_head_epochs}")
        super().__init__(model_fn, training)
        self.head_epochs = head_epochs
        self.unseen_head_epochs = (
            unseen_head_epochs
            if unseen_head_epochs is not None
            else max(1, head_epochs) * training.participations
        )
        self.head_lr = head_lr  # None: the round's learning rate (the initial one at the end)
        self.head_names = set(self._work.head_parameter_names())
        self.body_names = [n for n in self._work.state_dict() if n not in self.head_names]

    def _head(self, weights: Weights) -> Weights:
        # in a fixed order: a set's order varies with PYTHONHASHSEED, and so did checkpoints
        return {n: weights[n].copy() for n in sorted(self.head_names)}

    def _train_head(
        self, model: EmbedHeadModel, client: ClientData, epochs: int, lr: float, seed: int
    ) -> None:
        if epochs == 0 or client.num_train == 0:
            return
        z, _ = embed_and_logits(model, client.x_train)
        z_train = torch.from_numpy(z).to(client.y_train.device)
        local_sgd(
            model.classifier,
            z_train,
            client.y_train,
            epochs_only(self.training),
            lr,
            seed,
            epochs=epochs,
        )

    def client_update(
        self, global_weights: Weights, client: ClientData, state: ClientState, lr: float, seed: int
    ) -> ClientResult:
        model = self._work
        set_weights(model, {**global_weights, **state.get("head", self._head(global_weights))})
        self._train_head(model, client, self.head_epochs, self.head_lr or lr, seed)
        body_params = [p for n, p in model.named_parameters() if n not in self.head_names]
        loss = local_sgd(
            model,
            client.x_train,
            client.y_train,
            self.training,
            lr,
            sub_seed(seed, 1),
            params=body_params,
        )
        weights = get_weights(model)
        body = {n: weights[n] for n in self.body_names}
        return ClientResult(body, client.num_train, {"head": self._head(weights)}, loss)

    def client_updates(
        self, global_weights: Weights, cohort: Cohort, lr: float
    ) -> list[ClientResult]:
        """`client_update` for several clients: their heads step together on the embeddings of
        the global body (every client's, as `client_update` computes them), then their bodies
        step together with the heads held."""
        model = self._work
        device = cohort.device
        set_weights(model, global_weights)
        head_training = epochs_only(self.training)
        # the classifier's own names (weight, bias) for its functional call
        local = {n: n.removeprefix("classifier.") for n in sorted(self.head_names)}
        head_lanes = []
        for client, state, seed in cohort:
            head = state.get("head", self._head(global_weights))
            z = torch.from_numpy(embed_and_logits(model, client.x_train)[0]).to(device)
            schedule = batch_schedule(client.num_train, head_training, seed, self.head_epochs)
            head_lanes.append(
                Lane(
                    {local[n]: p for n, p in self.params(head, device, list(local)).items()},
                    {},
                    z,
                    client.y_train,
                    list(schedule),
                )
            )
        trained_heads, _ = self.step(
            head_lanes,
            self.head_lr or lr,
            cross_entropy_loss(model.classifier),
            training=head_training,
        )
        heads = [{n: w[local[n]] for n in local} for w in trained_heads]
        start = self.params(
            global_weights, device, [n for n in self.param_names if n not in self.head_names]
        )
        lanes = [
            self.lane(
                start,
                client,
                sub_seed(seed, 1),
                fixed=self.params(head, device, sorted(self.head_names)),
            )
            for client, head, seed in zip(cohort.clients, heads, cohort.seeds, strict=True)
        ]
        trained, losses = self.step(lanes, lr)
        return [
            ClientResult(
                {n: w for n, w in {**global_weights, **t}.items() if n in self.body_names},
                c.num_train,
                {"head": head},
                loss,
            )
            for t, c, head, loss in zip(trained, cohort.clients, heads, losses, strict=True)
        ]

    def aggregate(
        self, global_weights: Weights, results: list[ClientResult], total_samples: int, seed: int
    ) -> Weights:
        body = {n: global_weights[n] for n in self.body_names}
        new_body = aggregate_weights(
            body, [(r.weights, r.num_samples) for r in results], total_samples
        )
        return {**global_weights, **new_body}

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        model = self.model_fn()
        own = "head" in state
        set_weights(model, {**global_weights, **state.get("head", self._head(global_weights))})
        epochs = self.head_epochs if own else self.unseen_head_epochs
        self._train_head(model, client, epochs, self.head_lr or self.training.lr, seed)
        model.eval()
        return PersonalModel(model_predictor(model), {"head_epochs": epochs})
