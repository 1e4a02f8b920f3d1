"""pFedGP (Achituve et al. 2021), CPU-sized: a deep kernel shared by all clients (the model's
`embed`, trained federatedly) and a Gaussian-process classifier per client built on that
client's own data.

What is kept from pFedGP: the shared network is trained only through the GP (the model's linear
head is unused), with pFedGP's default "predictive likelihood" objective -- a client splits each
mini-batch into a context half and a target half, builds its GP on the context and is scored by
the log-likelihood of the target labels; an RBF kernel with pFedGP's output scale (8); pFedGP's
label map (a client's GP has outputs only for the classes in its own data, the others get
probability 0); each client predicts with a GP conditioned on its own training split, so unseen
clients need no training at all, only their data.

What is simplified, stated plainly: pFedGP's binary tree of Polya-Gamma augmented GPs (Gibbs
sampling per node) is replaced by Dirichlet-based GP classification (Milios et al. 2018): one
GP regression per class on log-space pseudo-targets with heteroscedastic noise, closed form, no
sampling. Class probabilities use the mean-field approximation of E[softmax(f)],
softmax(mu / sqrt(1 + pi var / 8)). Embeddings are L2-normalised before the kernel (length scale
0.5) so the kernel's range does not depend on the embedding's scale. A client's GP uses at most
`max_context` of its training samples (seeded subsample): exact GP cost is cubic in them.
The mini-batch is the shared TrainingConfig's (pFedGP builds its GP on the whole client; a larger
`batch_size` here moves closer to that).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from fed_train.algorithms.base import (
    ClientData,
    ClientState,
    FederatedAlgorithm,
    LossFn,
    PersonalModel,
    Weights,
)
from fed_train.models import EmbedHeadModel, ModelFactory
from fed_train.training_config import TrainingConfig

CLASS_CHUNK = 16  # classes solved together: bounds memory at chunk x context^2


def dirichlet_targets(
    y: torch.Tensor, num_classes: int, alpha_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Milios et al.'s transform: labels -> log-normal pseudo-targets and their noise variance."""
    a = nn.functional.one_hot(y, num_classes).to(torch.float64) + alpha_eps
    noise = torch.log1p(1.0 / a)
    return torch.log(a) - noise / 2.0, noise


def rbf_kernel(
    a: torch.Tensor, b: torch.Tensor, lengthscale: float, outputscale: float
) -> torch.Tensor:
    sq = (a.pow(2).sum(1, keepdim=True) - 2.0 * a @ b.T + b.pow(2).sum(1)).clamp_min(0.0)
    return outputscale * torch.exp(-sq / (2.0 * lengthscale**2))


def gp_posterior(
    z_context: torch.Tensor,
    y_context: torch.Tensor,
    z_query: torch.Tensor,
    num_classes: int,
    *,
    lengthscale: float = 0.5,
    outputscale: float = 8.0,
    alpha_eps: float = 0.01,
    jitter: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior mean and variance [n_query, C] of the per-class latent functions, each a GP
    with a constant prior mean (the class's mean pseudo-target), conditioned on the context.
    Differentiable in the embeddings; computed in the embeddings' dtype."""
    dtype = z_context.dtype
    targets, noise = (t.to(dtype) for t in dirichlet_targets(y_context, num_classes, alpha_eps))
    prior = targets.mean(0)
    k_cc = rbf_kernel(z_context, z_context, lengthscale, outputscale)
    k_qc = rbf_kernel(z_query, z_context, lengthscale, outputscale)
    eye = torch.eye(len(z_context), dtype=dtype, device=z_context.device)
    means, variances = [], []
    for start in range(0, num_classes, CLASS_CHUNK):
        cls = slice(start, min(start + CLASS_CHUNK, num_classes))
        a = k_cc + torch.diag_embed(noise[:, cls].T) + jitter * eye  # [c, m, m]
        chol = torch.linalg.cholesky(a)
        resid = (targets[:, cls] - prior[cls]).T.unsqueeze(-1)  # [c, m, 1]
        weights = torch.cholesky_solve(resid, chol)
        means.append(prior[cls] + (k_qc @ weights).squeeze(-1).T)
        v = torch.linalg.solve_triangular(chol, k_qc.T.expand(chol.shape[0], -1, -1), upper=False)
        variances.append((outputscale - v.pow(2).sum(1)).clamp_min(0.0).T)
    return torch.cat(means, 1), torch.cat(variances, 1)


def gp_logits(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Mean-field approximation of E[softmax(f)]: shrink each mean by its uncertainty."""
    return mean / torch.sqrt(1.0 + math.pi / 8.0 * var)


def normalise(z: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(z, dim=1)


def client_classes(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pFedGP's label map: the classes present in the client's data and its labels renumbered
    0..K-1. The GP only has outputs for those; other classes get probability 0."""
    classes, local = torch.unique(y, sorted=True, return_inverse=True)
    return classes, local


class PFedGP(FederatedAlgorithm):
    name = "pfedgp"
    title = "pFedGP"
    job_cost = 2.0

    def __init__(
        self,
        model_fn: ModelFactory,
        training: TrainingConfig,
        lengthscale: float = 0.5,
        outputscale: float = 8.0,
        alpha_eps: float = 0.01,
        predict_ratio: float = 0.5,
        max_context: int = 1000,
        batch_size: int | None = None,
    ) -> None:
        for name, value in (
            ("lengthscale", lengthscale),
            ("outputscale", outputscale),
            ("alpha_eps", alpha_eps),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0.0 < predict_ratio < 1.0:
            raise ValueError(f"predict_ratio must be in (0, 1), got {predict_ratio}")
        if max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {max_context}")
        super().__init__(
            model_fn, replace(training, batch_size=batch_size) if batch_size else training
        )
        self.kernel = {
            "lengthscale": lengthscale,
            "outputscale": outputscale,
            "alpha_eps": alpha_eps,
        }
        self.predict_ratio = predict_ratio
        self.max_context = max_context
        self.num_classes = int(self._work.classifier.out_features)

    def batch_loss(self, seed: int) -> LossFn:
        """The negative log predictive likelihood of a random target part of each batch under the
        GP built on the rest (the parts drawn by a generator seeded `seed`)."""
        generator = torch.Generator().manual_seed(seed)

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = normalise(model.embed(x))
            n = len(y)
            if n < 2:  # nothing to condition on: no signal, but keep the graph for backward
                return z.sum() * 0.0
            order = torch.randperm(n, generator=generator).to(y.device)
            n_target = min(n - 1, max(1, round(self.predict_ratio * n)))
            target, context = order[:n_target], order[n_target:]
            classes, y_context = client_classes(y[context])
            # targets of a class absent from the context cannot be predicted: leave them out
            target = target[torch.isin(y[target], classes)]
            if len(target) == 0 or len(classes) < 2:
                return z.sum() * 0.0
            mean, var = gp_posterior(z[context], y_context, z[target], len(classes), **self.kernel)
            y_target = torch.searchsorted(classes, y[target])
            return nn.functional.cross_entropy(gp_logits(mean, var), y_target)

        return loss

    @torch.no_grad()
    def _embed(self, model: EmbedHeadModel, x: torch.Tensor) -> torch.Tensor:
        model.eval()
        parts = [normalise(model.embed(x[i : i + 1024])) for i in range(0, len(x), 1024)]
        return (
            torch.cat(parts).double()
            if parts
            else torch.zeros(0, model.embedding_dim, device=x.device)
        )

    def personalize(
        self, global_weights: Weights, client: ClientData, state: ClientState, seed: int
    ) -> PersonalModel:
        model = self.model_with(global_weights)
        keep = np.arange(client.num_train)
        if len(keep) > self.max_context:
            keep = np.sort(
                np.random.default_rng(seed).choice(len(keep), self.max_context, replace=False)
            )
        z_context = self._embed(model, client.x_train[torch.from_numpy(keep)])
        classes, y_context = client_classes(client.y_train[torch.from_numpy(keep)])
        num_classes = self.num_classes

        @torch.no_grad()
        def predict(x: torch.Tensor) -> np.ndarray:
            out = np.zeros((len(x), num_classes))
            if len(z_context) == 0:
                out[:] = 1.0 / num_classes
                return out
            for i in range(0, len(x), 1024):
                mean, var = gp_posterior(
                    z_context,
                    y_context,
                    self._embed(model, x[i : i + 1024]),
                    len(classes),
                    **self.kernel,
                )
                out[i : i + 1024, classes.cpu().numpy()] = (
                    torch.softmax(gp_logits(mean, var), 1).cpu().numpy()
                )
            return out

        return PersonalModel(predict, {"context": int(len(keep)), "classes": int(len(classes))})
