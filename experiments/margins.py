"""Margins for every verdict the project prints. A claim is called "agree" or "disagree" only
where its effect clears its margin: a 95% bootstrap interval over clients that excludes the
claim's threshold, or, for the on-device stream, an effect beyond two standard errors over the
(seed, client) streams. Anything closer is "inconclusive". The across-seed tables
(experiments.table_seeds) use the same bootstrap and call, in their own words ("knnper ahead").

Rows from several seeds (a `seed` column, `knnper experiment --seeds N`) are pooled: a client is
(seed, client id), and the bootstrap resamples clients within their own seed, since each seed is
an independently drawn partition."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import groupby
from typing import Any

import numpy as np

DRAWS = 1000
AGREE, DISAGREE, INCONCLUSIVE = "agree", "disagree", "inconclusive"


# One independent sample: its size, or the sizes of its strata (the seeds: consecutive blocks of
# its units, each resampled on its own).
Sample = int | Sequence[int]


def _total(sample: Sample) -> int:
    return sample if isinstance(sample, int) else sum(sample)


def resample(rng: np.random.Generator, sample: Sample, draws: tuple[int, ...] = ()) -> np.ndarray:
    """Indices drawn with replacement, each stratum's from its own block: a seed's clients are
    only ever replaced by clients of the same seed. One stratum draws exactly as a plain size.
    `draws`: that many resamples at once, one per row (each stratum's block drawn whole)."""
    if isinstance(sample, int):
        return rng.integers(0, sample, (*draws, sample))
    starts = np.cumsum([0, *sample])
    return np.concatenate(
        [np.zeros((*draws, 0), dtype=np.int64)]
        + [
            start + rng.integers(0, n, (*draws, n))
            for start, n in zip(starts[:-1], sample, strict=True)
            if n
        ],
        axis=-1,
    )


def interval(
    effect: Callable[[list[np.ndarray]], Any],
    sizes: Sequence[Sample],
    *,
    draws: int = DRAWS,
    seed: int = 0,
    batched: bool = False,
) -> dict[str, float]:
    """The effect on the data as measured and its 95% bootstrap interval. `sizes` are the
    independent samples (one per separately partitioned run; an Aligned's `strata` where its rows
    come from several seeds): each draw resamples every one of them with replacement and passes
    the index arrays to `effect`. A `batched` effect gets every draw at once instead (index
    arrays [draws, n], each sample's drawn whole in turn) and returns one value per draw, so
    thousands of draws cost a few array operations; it must give the same value on one draw's
    1-D arrays (the point estimate). One sample draws the same indices either way."""
    point = effect([np.arange(_total(n)) for n in sizes])
    rng = np.random.default_rng(seed)
    if batched:
        samples = np.asarray(effect([resample(rng, n, (draws,)) for n in sizes]), dtype=float)
    else:
        samples = np.array(
            [effect([resample(rng, n) for n in sizes]) for _ in range(draws)], dtype=float
        )
    low, high = np.nanpercentile(samples, [2.5, 97.5])
    return {"effect": float(point), "low": float(low), "high": float(high)}


def call(
    iv: Mapping[str, float],
    threshold: float = 0.0,
    *,
    above: bool = True,
    words: tuple[str, str, str] = (AGREE, DISAGREE, INCONCLUSIVE),
) -> str:
    """The claim "effect > threshold" (or "< threshold" with above=False), from its interval:
    words[0] where the interval bears the claim out, words[1] where it contradicts it, words[2]
    where it holds the threshold (the across-seed tables name the method ahead instead)."""
    agree, disagree, neither = words
    if iv["low"] > threshold:
        return agree if above else disagree
    if iv["high"] < threshold:
        return disagree if above else agree
    return neither


def two_se(values: Sequence[float], threshold: float = 0.0) -> tuple[dict[str, float], str]:
    """Mean of independent per-unit effects, its standard error, and the call "mean > threshold"
    with a margin of two standard errors."""
    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("inf")
    iv = {"effect": mean, "se": se, "low": mean - 2 * se, "high": mean + 2 * se}
    return iv, call(iv, threshold)


def tally(calls: Sequence[str]) -> str:
    """One verdict over several points: "agree" only where every point clears its margin,
    "partly" where some do, "disagree" where none does and some contradict, else inconclusive."""
    if not calls:
        return "not measured"
    agrees, disagrees = calls.count(AGREE), calls.count(DISAGREE)
    if agrees == len(calls):
        return AGREE
    if agrees:
        return "partly"
    return DISAGREE if disagrees else INCONCLUSIVE


def pp(iv: Mapping[str, float], scale: float = 100.0, unit: str = " pp") -> str:
    """'+1.23 pp [+0.40, +2.10]' (95% interval) or '+1.23 pp +- 2 SE 0.80'."""
    if "se" in iv:
        return f"{scale * iv['effect']:+.2f}{unit} (2 SE {2 * scale * iv['se']:.2f})"
    return (
        f"{scale * iv['effect']:+.2f}{unit} [{scale * iv['low']:+.2f}, {scale * iv['high']:+.2f}]"
    )


def statistic(values: np.ndarray, weights: np.ndarray, stat: str) -> np.ndarray:
    """Along the last axis: the mean weighted by test size ("mean"), or the bottom decile
    ("bottom_decile", evaluation.bottom_decile's ceil(M/10)-th worst client)."""
    if stat == "mean":
        return (values * weights).sum(-1) / weights.sum(-1)
    k = int(np.ceil(values.shape[-1] / 10)) - 1
    return np.sort(values, axis=-1)[..., k]


def unit(row: Mapping[str, Any]) -> tuple[Any, int]:
    """Who a client row is: (seed, client id); the seed is None in a one-seed run's rows."""
    return row.get("seed"), int(row["client_id"])


def strata(units: Sequence[tuple[Any, int]]) -> tuple[int, ...]:
    """How many of the sorted `units` each seed holds, in order: what `interval` resamples."""
    return tuple(len(list(block)) for _, block in groupby(units, key=lambda u: u[0]))


class Aligned:
    """Per-client values of several points (one row each), over the clients present and scored
    in all of them, with each client's test size as its weight. Clients are sorted by (seed,
    client id), so `strata` gives each seed's block for `interval`."""

    def __init__(
        self,
        clients: Iterable[Mapping[str, Any]],
        points: Sequence[Mapping[str, Any]],
        value: str = "accuracy",
        weight: str = "n_test",
        keep: Callable[[Mapping[str, Any]], bool] = lambda r: True,
    ) -> None:
        tables = []
        rows = [r for r in clients if keep(r)]
        for point in points:
            tables.append(
                {
                    unit(r): r
                    for r in rows
                    if all(_same(r.get(k), v) for k, v in point.items())
                    and r.get(value) is not None
                    and r.get(weight)
                }
            )
        ids = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
        self.ids = ids
        self.strata = strata(ids)
        self.values = np.array([[float(t[i][value]) for i in ids] for t in tables])
        self.weights = np.array([float(tables[0][i][weight]) for i in ids]) if ids else np.zeros(0)

    def __len__(self) -> int:
        return len(self.ids)

    def means(self, idx: np.ndarray) -> np.ndarray:
        """Test-size-weighted mean of each point over the clients `idx`."""
        return statistic(self.values[:, idx], self.weights[idx], "mean")

    def bottom_deciles(self, idx: np.ndarray) -> np.ndarray:
        """Each point's ceil(M/10)-th worst client (evaluation.bottom_decile) over `idx`."""
        return statistic(self.values[:, idx], self.weights[idx], "bottom_decile")


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, float) or isinstance(a, float):
        try:
            return abs(float(a) - float(b)) < 1e-12
        except (TypeError, ValueError):
            return False
    return str(a) == str(b)


def paired(aligned: Aligned, a: int, b: int, stat: str = "means") -> dict[str, float]:
    """Point a minus point b over the same clients (`stat`: "means" or "bottom_deciles"), with
    its 95% interval from resampling those clients."""
    of = getattr(aligned, stat)
    return interval(lambda idx: float(of(idx[0])[a] - of(idx[0])[b]), [aligned.strata])
