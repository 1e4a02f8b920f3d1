"""The kNN-Per head: kernel posterior over stored neighbours and its interpolation with the global
model. This is the only copy of the math; server-side evaluation calls it too, so the accuracy a
benchmark reports is the accuracy a device gets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .values import is_integer, is_real

LAMBDA_GRID: tuple[float, ...] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
# The paper's fixed setting, and the one place these defaults live: every signature and flag
# that takes k, sigma or the embedding normalisation defaults to these names.
DEFAULT_K = 10
DEFAULT_SIGMA = 1.0
DEFAULT_NORMALIZE = "none"
LAMBDA_ESTIMATORS: tuple[str, ...] = ("val", "loo+val")
# Mean log-losses that differ by less than this are a tie when choosing: on a few dozen
# validation samples smaller differences are noise (fp32 against int8 keys of the same samples
# differ by about 1e-3), and a tie then goes to the simpler choice (the smaller lambda, the
# fewer bytes) instead of to the noise.
NLL_DECIMALS = 2
# What a device can run: k indexes arrays as an int64, and the kernel divides squared distances
# by p * sigma, which must stay a normal float32 for every embedding width (1 to 65,536) so that
# the device's float32 arithmetic neither underflows it to 0 (0/0 is NaN) nor overflows it.
K_MAX = 2**63 - 1
SIGMA_MIN, SIGMA_MAX = 1e-30, 1e30


def k_sigma_problem(k: object = None, sigma: object = None) -> str | None:
    """Why k or sigma (None: not given) cannot run on a device, or None when both can. One
    check for flags, saved kNN choices and manifests alike."""
    if k is not None and (not is_integer(k) or not 1 <= k <= K_MAX):
        return f"k must be an integer from 1 to {K_MAX} (2^63 - 1), got {k!r}"
    if sigma is not None and (not is_real(sigma) or not SIGMA_MIN <= sigma <= SIGMA_MAX):
        return f"sigma must be a number from {SIGMA_MIN:g} to {SIGMA_MAX:g}, got {sigma!r}"
    return None


# what the kNN posterior is interpolated with: the global model's, or a linear head fitted on
# the client's own train embeddings (with an l2 penalty)
KNN_BASES = ("global", "linear")


def base_problem(base: object, l2: object) -> str | None:
    """Why (base, l2) is not a kNN base, or None when it is: "global" without an l2, or
    "linear" with a positive one. One check for settings, saved choices and algorithms alike."""
    linear_l2 = l2 is not None and is_real(l2, finite=True) and l2 > 0
    if base not in KNN_BASES or (base == "linear") != linear_l2:
        return f"base must be 'global', or 'linear' with l2 > 0; got {base!r}, l2={l2}"
    return None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, shifted by the row maximum so large logits cannot overflow."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def kernel_posterior(
    sq_distances: np.ndarray,
    neighbor_labels: np.ndarray,
    num_classes: int,
    sigma: float,
    embedding_dim: int,
) -> np.ndarray:
    """p_knn[y] proportional to sum over neighbours of label y of exp(-d^2 / (p * sigma)).

    Computed as a softmax over the k neighbours (the smallest distance subtracted first), so
    neighbours that are all far away still give a proper distribution instead of 0/0.
    """
    sq = np.asarray(sq_distances, dtype=np.float64)
    labels = np.asarray(neighbor_labels, dtype=np.int64)
    logits = -(sq - sq.min(axis=1, keepdims=True)) / (embedding_dim * sigma)
    weights = np.exp(logits)
    weights /= weights.sum(axis=1, keepdims=True)
    # one bincount over (row, label) cells: the same sums, in the same order, as np.add.at
    cells = (np.arange(sq.shape[0])[:, None] * num_classes + labels).ravel()
    out = np.bincount(cells, weights.ravel(), minlength=sq.shape[0] * num_classes)
    return out.reshape(sq.shape[0], num_classes)


def interpolate(p_local: np.ndarray, p_global: np.ndarray, lam: float) -> np.ndarray:
    """lambda * p_local + (1 - lambda) * p_global: lambda=0 is the global model, 1 the kNN alone."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    return lam * p_local + (1.0 - lam) * p_global


def split_score(p: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean log-loss) of class probabilities `p` on labels `y`: what every choice
    made on a validation split is judged by (`split_sums` divided by the count)."""
    if len(y) == 0:
        return 0.0, 0.0
    correct, nll = split_sums(p, y)
    return correct / len(y), nll / len(y)


def choice_key(accuracy: float | None, nll: float | None, *tie_breaks: float) -> tuple:
    """The one ranking of validation scores, smallest first: the best accuracy, then the lower
    log-loss to NLL_DECIMALS, then the caller's tie-breaks in order (a smaller lambda, fewer
    bytes). Every place that chooses a lambda, a datastore or a kNN configuration ranks by it,
    so the server, the exporter and the device choose alike on the same data."""
    acc = 0.0 if accuracy is None else accuracy
    loss = 0.0 if nll is None else nll
    return (-round(acc, 12), round(loss, NLL_DECIMALS), *tie_breaks)


def datastore_key(
    accuracy: float | None, nll: float | None, *, trained: bool, nbytes: int
) -> tuple:
    """choice_key for a datastore candidate, the exporter's and the device's alike. After the
    validation score, a store of the samples themselves (flat, HNSW) goes before a trained
    compression of them (ProtoNN): a tie on a few dozen validation samples is noise, and the
    stored samples are what the server's kNN-Per evaluation measured. Then the fewer bytes."""
    return choice_key(accuracy, nll, trained, nbytes)


def split_sums(p: np.ndarray, y: np.ndarray) -> tuple[int, float]:
    """(samples right, summed log-loss) of class probabilities `p` on labels `y`: the sums that
    pool across clients by addition, and whose means are `split_score`'s to the last bit."""
    y = np.asarray(y, dtype=np.int64)
    if len(y) == 0:
        return 0, 0.0
    correct = int(np.sum(p.argmax(axis=1) == y))
    nll = float(-np.sum(np.log(np.clip(p[np.arange(len(y)), y], 1e-12, None))))
    return correct, nll


def lambda_counts(
    p_local: np.ndarray, p_global: np.ndarray, y: np.ndarray, grid: tuple[float, ...] = LAMBDA_GRID
) -> np.ndarray:
    """[len(grid), 3]: for each lambda, samples right, summed log-loss and samples scored. Sums,
    not means, so that clients' evidence pools by addition (a federated client sends only these)
    and `split_score`'s means are these divided by the count, to the last bit."""
    out = np.zeros((len(grid), 3))
    for i, lam in enumerate(grid):
        if len(y):
            out[i] = (*split_sums(interpolate(p_local, p_global, lam), y), len(y))
    return out


LAMBDA_RULES: tuple[str, ...] = ("client", "pooled", "shrunk")


@dataclass(frozen=True)
class LambdaRule:
    """How a client's lambda comes from validation evidence ([grid, 3] `lambda_counts`).

    "client": its own evidence only (the paper's rule). "pooled": one lambda for every client,
    from `pooled`, the seen clients' evidence summed; a few dozen validation samples cannot tell
    seven grid values apart, the pooled splits can. "shrunk": the client's own evidence plus the
    pooled rates counted as `prior_samples` samples (a pseudo-count prior, the empirical-Bayes
    posterior mean), so a client's own data decides only where it has enough of it."""

    name: str = "client"
    pooled: tuple[tuple[float, float, float], ...] = ()
    prior_samples: float = 0.0
    grid: tuple[float, ...] = LAMBDA_GRID

    def __post_init__(self) -> None:
        if self.name not in LAMBDA_RULES:
            raise ValueError(
                f"lambda rule must be one of {', '.join(LAMBDA_RULES)}, got {self.name!r}"
            )
        if (
            not self.grid
            or len(set(self.grid)) != len(self.grid)
            or not all(0.0 <= lam <= 1.0 for lam in self.grid)
        ):
            raise ValueError(f"a lambda grid holds distinct values in [0, 1], got {self.grid}")
        if self.name != "client":
            pooled = np.asarray(self.pooled, dtype=np.float64)
            if (
                pooled.shape != (len(self.grid), 3)
                or not np.isfinite(pooled).all()
                or (pooled < 0).any()
                or not (pooled[:, 2] > 0).all()
            ):
                raise ValueError(
                    f"the {self.name} lambda rule needs pooled evidence: "
                    f"{len(self.grid)} rows of (correct, log-loss sum, samples > 0)"
                )
        if not (np.isfinite(self.prior_samples) and self.prior_samples >= 0):
            raise ValueError(f"prior_samples must be finite and >= 0, got {self.prior_samples}")

    def choose_from_counts(self, own: np.ndarray) -> float:
        """The lambda this rule gives a client whose own evidence is `own` ([grid, 3])."""
        own = np.asarray(own, dtype=np.float64)
        if self.name == "client":
            evidence = own
        elif self.name == "pooled":
            evidence = np.asarray(self.pooled, dtype=np.float64)
        else:
            pooled = np.asarray(self.pooled, dtype=np.float64)
            evidence = own + self.prior_samples * pooled / pooled[:, 2:3]
        if evidence[0, 2] == 0:
            return 0.5  # nothing to go on
        return min(
            self.grid, key=lambda lam: choice_key(*_rates(evidence[self.grid.index(lam)]), lam)
        )

    def choose(self, p_local: np.ndarray, p_global: np.ndarray, y: np.ndarray) -> float:
        """The lambda this rule gives a client from its validation posteriors."""
        return self.choose_from_counts(lambda_counts(p_local, p_global, y, self.grid))

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "pooled": [list(map(float, r)) for r in self.pooled],
            "prior_samples": float(self.prior_samples),
            "grid": list(self.grid),
        }

    @classmethod
    def from_dict(cls, d: dict) -> LambdaRule:
        return cls(
            str(d["name"]),
            tuple(tuple(float(v) for v in r) for r in d["pooled"]),
            float(d["prior_samples"]),
            tuple(float(v) for v in d["grid"]),
        )


CLIENT_RULE = LambdaRule()


def _rates(counts: np.ndarray) -> tuple[float, float]:
    correct, nll, n = counts
    return float(correct / n), float(nll / n)


Posteriors = tuple[np.ndarray | None, np.ndarray, np.ndarray]


def estimator_evidence(
    estimator: str,
    p_knn_val: np.ndarray,
    p_global_val: np.ndarray,
    y_val: np.ndarray,
    loo: Posteriors | None = None,
) -> Posteriors:
    """The samples a client's lambda is judged on. "val": its validation split. "loo+val": the
    validation split plus `loo`, the leave-one-out kNN posteriors of its own datastore with the
    global model's output and the labels of those samples: many more samples than ~30
    validation ones (the kNN part is honest there, the global model saw them in training)."""
    if estimator not in LAMBDA_ESTIMATORS:
        raise ValueError(
            f"lambda estimator must be one of {', '.join(LAMBDA_ESTIMATORS)}, got {estimator!r}"
        )
    if estimator == "loo+val" and loo is not None and loo[0] is not None:
        return (
            np.concatenate([loo[0], p_knn_val]),
            np.concatenate([loo[1], p_global_val]),
            np.concatenate([loo[2], y_val]),
        )
    return p_knn_val, p_global_val, y_val


def leave_one_out_posteriors(
    keys: np.ndarray, labels: np.ndarray, num_classes: int, k: int, sigma: float
) -> np.ndarray | None:
    """Each stored key's kNN posterior from the other stored keys (None with fewer than two):
    the datastore half of the "loo+val" estimator."""
    sq, idx = leave_one_out_search(keys, k)
    if sq.shape[1] == 0:
        return None
    return kernel_posterior(sq, np.asarray(labels)[idx], num_classes, sigma, keys.shape[1])


# Top-k method, chosen by measured switch points (benchmarks/runtime_scan.py, results in
# benchmarks/results/runtime/topk.csv): the blockwise threshold top-k partitions the minimum of
# each block of _BLOCK distances first and searches only the k best blocks. At k = 10 it was
# 0.62x argpartition's speed at 2,000 keys, 0.96x at 3,000, 1.18x at 5,000 and 3x at 10,000,
# so it is used from _BLOCKWISE_MIN_KEYS_PER_K keys per neighbour on.
_BLOCK = 64
_BLOCKWISE_MIN_KEYS_PER_K = 400
# Queries are searched in chunks so a distance matrix never holds more than this many cells.
_MAX_CHUNK_CELLS = 1 << 22
# Keys stored narrower than float32 are widened this many at a time (a block of d x 1024 float32
# stays in the L2 cache and is the only scratch the scan holds), so no full-size float32 copy of
# them ever exists.
_DEQUANT_BLOCK = 1024


def exact_search(
    queries: np.ndarray,
    keys: np.ndarray,
    k: int,
    *,
    key_norms: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force Euclidean k nearest neighbours: (squared distances, indices), nearest first.

    `keys` is [n, p]; `key_norms` (the squared norms of `keys`, float32) may be passed by callers
    that search the same keys many times; the result is the same. Equal distances are listed in
    index order.
    """
    keys = np.asarray(keys, dtype=np.float32)
    if key_norms is None:
        key_norms = np.einsum("ij,ij->i", keys, keys)
    return search_transposed(queries, keys.T, k, key_norms=key_norms)


def search_transposed(
    queries: np.ndarray,
    keys_t: np.ndarray,
    k: int,
    *,
    key_norms: np.ndarray,
    scale: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """exact_search over keys stored transposed, [p, n], as float32, float16 or int8.

    The [p, n] layout lets one query's distances stream the keys at memory speed (a matrix-vector
    product over contiguous rows). Keys narrower than float32 are widened a block at a time;
    int8 keys stand for keys_t * scale[:, None] (one scale per dimension) and are met by the
    query quantised to int8 (`key_products`). `key_norms` are the squared norms of the keys as
    the search sees them (float32).
    """
    n = keys_t.shape[1]
    k = min(k, n)
    q = np.asarray(queries, dtype=np.float32)
    rows = max(1, _MAX_CHUNK_CELLS // max(n, 1))
    if q.shape[0] <= rows:
        return _search_chunk(q, keys_t, key_norms, scale, k)
    parts = [
        _search_chunk(q[s : s + rows], keys_t, key_norms, scale, k)
        for s in range(0, q.shape[0], rows)
    ]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def transposed_key_norms(keys_t: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Squared norms (float32 [n]) of keys stored [p, n] (times scale per dimension), a block
    at a time; a key holding NaN or inf gets a non-finite norm, so callers check this alone."""
    norms = np.empty(keys_t.shape[1], dtype=np.float32)
    for s, e, block in _float32_blocks(keys_t):
        if scale is not None:
            block *= scale[:, None]
        np.einsum("ij,ij->j", block, block, out=norms[s:e])
        if keys_t.dtype == np.float16 and not np.isfinite(keys_t[:, s:e]).all():
            norms[s:e] = np.inf  # _widen_half assumes finite halves: mark the block as bad
    return norms


# The query's int8 levels: 7 bits. onnxruntime's uint8 x int8 kernel on AVX2 without VNNI adds
# pairs of products in 16 bits with saturation (vpmaddubsw), so the shifted query
# (Q + QUERY_LEVELS + 1) must stay <= 127 for the integer products to be exact; measured here:
# wrong products with full 8-bit queries, exact with 7-bit ones.
QUERY_LEVELS = 63
# The shift that makes the quantised query uint8 for onnxruntime's integer kernel; each key's
# sum times it is taken back off the products (a flat datastore holds it: key_offsets_).
QUERY_SHIFT = QUERY_LEVELS + 1


def int8_query(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q [m, p] float32 holding integers in [-QUERY_LEVELS, QUERY_LEVELS], s [m, 1] float32)
    with Q * s ~ q * scale: the query quantised as the runtime's integer scan of int8 keys
    quantises it (one symmetric scale per query; a zero query gets s = 1), in the same float32
    steps."""
    qs = np.asarray(q, np.float32) * scale[None, :]
    peak = np.abs(qs).max(axis=1, keepdims=True)
    levels = np.float32(QUERY_LEVELS)
    s = np.where(peak > 0, peak / levels, np.float32(1.0)).astype(np.float32)
    return np.rint(qs / s), s


def key_products(q: np.ndarray, keys_t: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """q @ (keys as the search sees them), [m, n] float32, without widening all keys at once.

    int8 keys (`scale` given) meet the query quantised by `int8_query`, so these products are
    the float reference of the integer scan: integer products, exact in float32 while
    63 * 127 * p < 2^24 (p <= 2096), times the query's scale."""
    s = None
    if scale is not None:
        q, s = int8_query(q, scale)
    vector = q.shape[0] == 1  # a matrix-vector product streams the keys fastest
    if keys_t.dtype == np.float32:
        return (q[0] @ keys_t)[None, :] if vector else q @ keys_t
    out = np.empty((q.shape[0], keys_t.shape[1]), dtype=np.float32)
    for s_, e, block in _float32_blocks(keys_t):
        if vector:
            np.matmul(q[0], block, out=out[0, s_:e])
        else:
            np.matmul(q, block, out=out[:, s_:e])
    if s is not None:
        out *= s
    return out


def _float32_blocks(keys_t: np.ndarray):
    """(start, end, block) over keys_t's columns, each block widened to float32 in one reused
    buffer of _DEQUANT_BLOCK columns."""
    p, n = keys_t.shape
    width = min(n, _DEQUANT_BLOCK)
    buf = np.empty((p, width), dtype=np.float32)
    if keys_t.dtype == np.float16:
        bits = np.empty((p, width), np.uint32)
    for s in range(0, n, _DEQUANT_BLOCK):
        e = min(n, s + _DEQUANT_BLOCK)
        block = buf[:, : e - s]
        if keys_t.dtype == np.float16:
            _widen_half(keys_t[:, s:e], block, bits[:, : e - s])
        else:
            np.copyto(block, keys_t[:, s:e], casting="unsafe")
        yield s, e, block


_HALF_TO_SINGLE = np.float32(2.0**112)


def _widen_half(half: np.ndarray, out: np.ndarray, bits: np.ndarray) -> None:
    """Finite float16 -> float32, exactly (zeros and subnormals included), about 3x faster than
    numpy's own cast here: the exponent and mantissa bits moved into place and rescaled by
    2^112, the sign (parked in `out`) put back. Keys are checked finite at load."""
    np.copyto(bits, half.view(np.uint16), casting="unsafe")
    sign = out.view(np.uint32)
    np.bitwise_and(bits, 0x8000, out=sign)
    np.left_shift(sign, 16, out=sign)
    np.bitwise_and(bits, 0x7FFF, out=bits)
    np.left_shift(bits, 13, out=bits)
    magnitude = bits.view(np.float32)
    np.multiply(magnitude, _HALF_TO_SINGLE, out=magnitude)
    np.bitwise_or(sign, bits, out=sign)


def _search_chunk(
    q: np.ndarray,
    keys_t: np.ndarray,
    key_norms: np.ndarray,
    scale: np.ndarray | None,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    n = keys_t.shape[1]
    sq = key_products(q, keys_t, scale)
    sq *= -2.0
    sq += key_norms
    sq += np.einsum("ij,ij->i", q, q)[:, None]
    np.maximum(sq, 0.0, out=sq)
    if k >= n:
        idx = np.tile(np.arange(n), (q.shape[0], 1))
    elif n >= _BLOCKWISE_MIN_KEYS_PER_K * k and n // _BLOCK >= k:
        idx = blockwise_topk(sq, k)
    else:
        idx = np.argpartition(sq, k - 1, axis=1)[:, :k]
    if q.shape[0] == 1:  # the device's usual call: 1-D sorts cost a fraction of the 2-D ones
        row = idx[0]
        part = sq[0, row]
        order = np.lexsort((row, part))
        return part[order][None, :], row[order][None, :]
    part = np.take_along_axis(sq, idx, axis=1)
    order = np.lexsort((idx, part), axis=1)
    return np.take_along_axis(part, order, axis=1), np.take_along_axis(idx, order, axis=1)


def blockwise_topk(sq: np.ndarray, k: int) -> np.ndarray:
    """Indices (unordered) of the k smallest entries of each row of sq."""
    m, n = sq.shape
    full = n // _BLOCK
    minima = sq[:, : full * _BLOCK].reshape(m, full, _BLOCK).min(axis=2)
    if full * _BLOCK < n:
        minima = np.concatenate([minima, sq[:, full * _BLOCK :].min(axis=1, keepdims=True)], axis=1)
    blocks = np.argpartition(minima, k - 1, axis=1)[:, :k]
    cand = (blocks[:, :, None] * _BLOCK + np.arange(_BLOCK)[None, None, :]).reshape(m, -1)
    valid = cand < n
    cand = np.minimum(cand, n - 1)
    cand_sq = np.take_along_axis(sq, cand, axis=1)
    cand_sq[~valid] = np.inf
    best = np.argpartition(cand_sq, k - 1, axis=1)[:, :k]
    return np.take_along_axis(cand, best, axis=1)


NORMALIZATIONS: tuple[str, ...] = ("none", "l2")


def normalize_embeddings(z: np.ndarray, how: str) -> np.ndarray:
    """ "none" keeps the raw embedding; "l2" puts it on the unit sphere (zero vectors stay 0).
    Keys and queries must go through the same one."""
    z = np.asarray(z, dtype=np.float32)
    if how == "none":
        return z
    if how == "l2":
        norms = np.linalg.norm(z, axis=1, keepdims=True)
        return z / np.maximum(norms, np.float32(1e-12))
    raise ValueError(f"unknown embedding normalisation {how!r}; known: {', '.join(NORMALIZATIONS)}")


def leave_one_out_search(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each stored key's k nearest other keys (squared distances, indices), nearest first: the
    neighbours it would get if it were a new query, for estimating on the datastore itself."""
    n = len(keys)
    k = min(k, n - 1)
    if k < 1:
        return np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int64)
    sq, idx = exact_search(keys, keys, k + 1)
    own = idx == np.arange(n)[:, None]
    # equal distances are listed in index order, so duplicates can push a key's own entry out
    # of its k + 1: then the farthest entry is dropped instead
    own[~own.any(axis=1), -1] = True
    return sq[~own].reshape(n, k), idx[~own].reshape(n, k)


class KNNHead:
    """Exact kNN posterior over a float32 datastore, scikit-learn style: fit(z, y),
    predict_proba(z).

    Parameters
    ----------
    num_classes : the number of classes the labels range over (the posterior's columns).
    k : the neighbours each query's posterior is taken over.
    sigma : the kernel's scale: a neighbour at squared distance d^2 weighs
        exp(-d^2 / (p * sigma)), p the embedding's dimension (`kernel_posterior`).
    """

    def __init__(self, num_classes: int, k: int = DEFAULT_K, sigma: float = DEFAULT_SIGMA) -> None:
        self.num_classes = num_classes
        self.k = k
        self.sigma = sigma

    def fit(self, z: np.ndarray, y: np.ndarray) -> KNNHead:
        z = np.asarray(z, dtype=np.float32)
        y = np.asarray(y, dtype=np.int64)
        if z.ndim != 2 or y.shape != (z.shape[0],):
            raise ValueError(f"fit expects z [n, p] and y [n], got {z.shape} and {y.shape}")
        if z.shape[0] == 0:
            raise ValueError("fit needs at least one stored sample")
        self.keys_ = np.ascontiguousarray(z)
        self.labels_ = y
        return self

    def predict_proba(self, z: np.ndarray) -> np.ndarray:
        sq, idx = exact_search(z, self.keys_, self.k)
        return kernel_posterior(
            sq, self.labels_[idx], self.num_classes, self.sigma, self.keys_.shape[1]
        )

    def predict(self, z: np.ndarray) -> np.ndarray:
        return self.predict_proba(z).argmax(axis=1)
