"""A linear personal head: multinomial logistic regression on a client's embeddings, fitted in
numpy so a device can fit (and refit) it without torch or scikit-learn.

The objective is scikit-learn's `LogisticRegression` (lbfgs, unpenalised intercept) with
C = 1 / (n * l2) on the embeddings divided by their standard deviation (one number, over all
entries about each dimension's mean): mean cross-entropy + l2 / 2 * ||coef||^2 on that scale. The
rescaling makes one l2 grid mean the same for raw ReLU features of any magnitude and for unit-norm
embeddings (whose entries are ~1 / sqrt(p)). The embeddings are also centred, which with an
unpenalised intercept leaves the optimum unchanged but removes the large common direction of
all-positive ReLU features that slows the solver several-fold. Both are folded into `coef_` and
`intercept_`, so predicting is a plain affine map and softmax. Fitted by full-batch L-BFGS: it is
deterministic and needs some tens to hundreds of matrix products at these sizes (milliseconds).
"""

from __future__ import annotations

import numpy as np

from edge_runtime.knn import softmax
from edge_runtime.threads import BlasThreads

# Regularisation strengths searched on validation, strongest first (a tie goes to the first: the
# smoother head). Half-decades from 1 (little more than the client's label frequencies) to 1e-6
# (all but unregularised); on a few hundred standardised embeddings scikit-learn's default C = 1
# is l2 = 1 / n, about 10^-2.5.
L2_GRID: tuple[float, ...] = tuple(float(10.0 ** (-e / 2)) for e in range(0, 13))
DEFAULT_L2 = 1e-2
_MEMORY = 10  # L-BFGS correction pairs
_ARMIJO = 1e-4  # sufficient decrease of the backtracking line search
_MAX_HALVINGS = 40


class LinearHead:
    """Multinomial logistic regression, scikit-learn style: fit(z, y), predict_proba(z).

    Classes absent from the training labels get a zero weight column and an intercept low enough
    that on every training sample each has probability at most 1 / (n + 1): small, finite (the
    unpenalised optimum would be -inf), and below the likeliest seen class there.

    Parameters
    ----------
    num_classes : the number of classes the labels range over (the output's columns).
    l2 : the ridge penalty on the weights, l2 / 2 * ||coef||^2 added to the mean cross-entropy
        (on standardized embeddings; > 0).
    max_iter : L-BFGS iterations at most.
    tol : stop once the largest gradient entry is below it.
    """

    def __init__(
        self, num_classes: int, l2: float = DEFAULT_L2, max_iter: int = 500, tol: float = 1e-5
    ) -> None:
        self.num_classes = num_classes
        self.l2 = l2
        self.max_iter = max_iter
        self.tol = tol

    def fit(self, z: np.ndarray, y: np.ndarray) -> LinearHead:
        z, y = self._check_fit(z, y)
        n, p = z.shape
        mean = z.mean(axis=0)
        centred = z - mean
        scale = float(np.sqrt(np.mean(centred * centred))) or 1.0  # all equal: nothing to scale
        present = np.unique(y)
        coef = np.zeros((p, self.num_classes), np.float64)
        intercept = np.zeros(self.num_classes, np.float64)
        self.n_iter_ = 0
        if len(present) > 1:
            # one BLAS thread, as the runtime's scans: OpenBLAS's busy-waiting threads made a
            # fit 12x slower on a loaded two-core machine (1 s against 12 s at p = 512, C = 100)
            with BlasThreads()():
                w, b, self.n_iter_ = _lbfgs(
                    centred / scale,
                    np.searchsorted(present, y),
                    len(present),
                    self.l2,
                    self.max_iter,
                    self.tol,
                )
            coef[:, present] = w / scale
            intercept[present] = b - mean @ coef[:, present]
        absent = np.setdiff1d(np.arange(self.num_classes), present)
        if len(absent):
            logits = z @ coef[:, present] + intercept[present]
            intercept[absent] = _logsumexp(logits).min() - np.log(n + 1)
        self.coef_ = coef.astype(np.float32)
        self.intercept_ = intercept.astype(np.float32)
        return self

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=np.float32)
        if z.ndim != 2 or z.shape[1] != self.coef_.shape[0]:
            raise ValueError(f"predict_proba expects z [n, {self.coef_.shape[0]}], got {z.shape}")
        return softmax((z @ self.coef_ + self.intercept_).astype(np.float64))

    def predict(self, z: np.ndarray) -> np.ndarray:
        return self.predict_proba(z).argmax(axis=1)

    @property
    def nbytes(self) -> int:
        """What the head adds to a device's budget: its float32 weights and intercepts."""
        return int(self.coef_.nbytes + self.intercept_.nbytes)

    def _check_fit(self, z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not (isinstance(self.num_classes, int | np.integer) and self.num_classes >= 1):
            raise ValueError(f"num_classes must be a positive integer, got {self.num_classes!r}")
        if not (np.isfinite(self.l2) and self.l2 > 0):
            raise ValueError(f"l2 must be a positive number, got {self.l2!r}")
        if not (self.max_iter >= 1 and self.tol > 0):
            raise ValueError(
                f"max_iter must be >= 1 and tol > 0, got {self.max_iter!r} and {self.tol!r}"
            )
        z = np.asarray(z, dtype=np.float64)
        y = np.asarray(y)
        if z.ndim != 2 or y.shape != (z.shape[0],):
            raise ValueError(f"fit expects z [n, p] and y [n], got {z.shape} and {y.shape}")
        if z.shape[0] == 0:
            raise ValueError("fit needs at least one sample")
        if not np.isfinite(z).all():
            raise ValueError("z holds NaN or infinite values")
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(
                f"y must be in [0, {self.num_classes}), got labels from {y.min()} to {y.max()}"
            )
        return z, y.astype(np.int64)


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1)
    return top + np.log(np.exp(logits - top[:, None]).sum(axis=1))


def _lbfgs(
    z: np.ndarray, y: np.ndarray, k: int, l2: float, max_iter: int, tol: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """(coef [p, k], intercept [k], iterations) minimising the mean cross-entropy over k classes
    plus l2 / 2 * ||coef||^2, from zero, until the largest gradient entry is below tol."""
    n, p = z.shape
    onehot = np.zeros((n, k))
    onehot[np.arange(n), y] = 1.0

    def loss_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[: p * k].reshape(p, k), theta[p * k :]
        logits = z @ w + b
        lse = _logsumexp(logits)
        residual = (np.exp(logits - lse[:, None]) - onehot) / n
        loss = float(np.mean(lse - logits[np.arange(n), y]) + 0.5 * l2 * np.sum(w * w))
        return loss, np.concatenate([(z.T @ residual + l2 * w).ravel(), residual.sum(axis=0)])

    theta = np.zeros((p + 1) * k)
    loss, grad = loss_grad(theta)
    # the first step is 1 / L: the loss's Hessian is at most ||[z, 1]||^2 / (2n) + l2 (Boehning's
    # bound, with the Frobenius norm above the spectral one), so it cannot overshoot
    first_step = 1.0 / ((np.sum(z * z) + n) / (2 * n) + l2)
    pairs: list[tuple[np.ndarray, np.ndarray, float]] = []
    iteration = 0
    for iteration in range(1, max_iter + 1):
        if np.max(np.abs(grad)) <= tol:
            return theta[: p * k].reshape(p, k), theta[p * k :], iteration - 1
        direction = -_two_loop(grad, pairs) if pairs else -first_step * grad
        slope = float(grad @ direction)
        step = 1.0
        for _ in range(_MAX_HALVINGS):
            candidate = theta + step * direction
            new_loss, new_grad = loss_grad(candidate)
            if new_loss <= loss + _ARMIJO * step * slope:
                break
            step *= 0.5
        else:  # no decrease left at float64 precision: as converged as it gets
            break
        s, g_diff = candidate - theta, new_grad - grad
        curvature = float(s @ g_diff)
        if curvature > 1e-12 * float(g_diff @ g_diff):
            pairs = [*pairs[-(_MEMORY - 1) :], (s, g_diff, 1.0 / curvature)]
        theta, loss, grad = candidate, new_loss, new_grad
    return theta[: p * k].reshape(p, k), theta[p * k :], iteration


def _two_loop(grad: np.ndarray, pairs: list[tuple[np.ndarray, np.ndarray, float]]) -> np.ndarray:
    """L-BFGS's inverse-Hessian estimate times grad from the stored (s, y, 1 / s.y) pairs. The
    updates go through one scratch vector: fresh temporaries of this size cost more than the
    arithmetic."""
    q = grad.copy()
    scratch = np.empty_like(q)
    alphas = []
    for s, y, rho in reversed(pairs):
        alpha = rho * float(s @ q)
        q -= np.multiply(y, alpha, out=scratch)
        alphas.append(alpha)
    s, y, _ = pairs[-1]
    q *= float(s @ y) / float(y @ y)
    for (s, y, rho), alpha in zip(pairs, reversed(alphas), strict=True):
        q += np.multiply(s, alpha - rho * float(y @ q), out=scratch)
    return q
