"""The hierarchical, seed-paired bootstrap every report of an experiment uses.

An arm's result is a table of per-instance numbers for each training seed: ``values`` [seeds,
instances] over ``weights`` (the held-out loss: loss sums over tokens per document; a suite score:
per-instance scores over task weights, so the statistic is the mean over tasks). The statistic is
the ratio of sums, ``values.sum() / weights.sum()``. Both sources of variation are resampled, in
the order they arise: a replicate draws the training seeds with replacement, then, within each
drawn seed, the instances with replacement (a new draw for every drawn seed).

Two arms are *paired* when they share their seeds (stage-2 seed s of both arms continues from the
same stage-1 run, or both start from the same seed) and were scored on the same instances. A
paired difference draws the seed indices once and the instance indices once and applies both to
the two arms, taking the difference per replicate: what the two arms share (a good or bad seed,
an easy or hard instance) cancels. Unpaired arms are resampled independently.

With one seed a replicate resamples instances only: its interval says nothing about training
noise (the reports say so). With few seeds the percentile interval cannot reach beyond the range
of the per-seed values, so every paired difference also carries :func:`seed_level`: a t interval
over the per-seed differences (n - 1 degrees of freedom) and their sign count. Claims are worded
by the wider of the two.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from longctx.errors import LongctxError

CONFIDENCE = 0.95
# cells of one [chunk, seeds, instances] gather: bounds the memory of a bootstrap
_CHUNK_CELLS = 1 << 22


class PairingError(LongctxError):
    """Two arms that claim pairing do not share seeds or instances."""


@dataclasses.dataclass(frozen=True)
class ArmSample:
    """One arm: ``values`` [seeds, instances] and ``weights`` (the same shape, or [instances] for
    weights every seed shares); ``seeds`` and ``instances`` label the rows and columns."""

    values: np.ndarray
    weights: np.ndarray
    seeds: tuple
    instances: tuple

    def __post_init__(self) -> None:
        values = np.asarray(self.values, dtype=float)
        weights = np.broadcast_to(np.asarray(self.weights, dtype=float), values.shape)
        if values.ndim != 2 or values.size == 0:
            raise LongctxError(
                f"values have shape {values.shape}; expected [seeds, instances], both >= 1"
            )
        if (len(self.seeds), len(self.instances)) != values.shape:
            raise LongctxError(
                f"{len(self.seeds)} seed and {len(self.instances)} instance labels for values "
                f"of shape {values.shape}; expected one label per row and per column"
            )
        if not (np.isfinite(values).all() and np.isfinite(weights).all()):
            raise LongctxError("values or weights hold a non-finite number; expected finite ones")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "instances", tuple(self.instances))

    @classmethod
    def of(cls, values, weights=None, seeds=None, instances=None) -> ArmSample:
        """Labels default to 0..n-1 and weights to ones (the statistic is then a plain mean)."""
        values = np.atleast_2d(np.asarray(values, dtype=float))
        weights = np.ones(values.shape[1]) if weights is None else weights
        seeds = range(values.shape[0]) if seeds is None else seeds
        instances = range(values.shape[1]) if instances is None else instances
        return cls(values, weights, tuple(seeds), tuple(instances))

    @property
    def estimate(self) -> float:
        return float(self.values.sum() / self.weights.sum())

    def per_seed(self) -> dict:
        """The statistic of each seed alone."""
        ratios = self.values.sum(1) / self.weights.sum(1)
        return {seed: float(r) for seed, r in zip(self.seeds, ratios, strict=True)}


@dataclasses.dataclass(frozen=True)
class Draws:
    """The indices of ``n_boot`` replicates: seeds [n_boot, S], instances [n_boot, S, N]."""

    seeds: np.ndarray
    instances: np.ndarray

    @classmethod
    def sample(cls, n_seeds: int, n_instances: int, n_boot: int, rng) -> Draws:
        check_replicates(n_boot)  # every report's --bootstrap ends here
        seeds = rng.integers(0, n_seeds, size=(n_boot, n_seeds))
        instances = rng.integers(0, n_instances, size=(n_boot, n_seeds, n_instances))
        return cls(seeds, instances)


def check_replicates(n_boot) -> None:
    """A report's --bootstrap: a count of replicates >= 1."""
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise LongctxError(f"--bootstrap {n_boot!r}; expected a count of replicates >= 1")


def replicates(arm: ArmSample, draws: Draws) -> np.ndarray:
    """The statistic on each replicate's drawn seeds and, within each, its drawn instances."""
    n_boot, n_seeds, n_instances = draws.instances.shape
    chunk = max(1, _CHUNK_CELLS // (n_seeds * n_instances))
    out = np.empty(n_boot)
    for start in range(0, n_boot, chunk):
        rows = draws.seeds[start : start + chunk, :, None]
        cols = draws.instances[start : start + chunk]
        values = arm.values[rows, cols].sum(axis=(1, 2))
        out[start : start + chunk] = values / arm.weights[rows, cols].sum(axis=(1, 2))
    return out


def bootstrap(arm: ArmSample, n_boot: int, rng) -> np.ndarray:
    """Replicates of one arm's statistic."""
    return replicates(arm, Draws.sample(*arm.values.shape, n_boot, rng))


def bootstrap_difference(
    a: ArmSample, b: ArmSample, n_boot: int, rng, paired: bool = True
) -> np.ndarray:
    """Replicates of statistic(a) - statistic(b): paired (one draw for both arms: their seeds and
    instances must match) or independent."""
    if not paired:
        return bootstrap(a, n_boot, rng) - bootstrap(b, n_boot, rng)
    check_paired(a, b)
    draws = Draws.sample(*a.values.shape, n_boot, rng)
    return replicates(a, draws) - replicates(b, draws)


def check_paired(a: ArmSample, b: ArmSample) -> None:
    if a.seeds != b.seeds:
        raise PairingError(
            f"paired arms have different training seeds ({list(a.seeds)} vs {list(b.seeds)}); "
            "pair only arms continued from the same seeds, or compare them unpaired"
        )
    if a.instances != b.instances:
        only = sorted(set(map(str, a.instances)) ^ set(map(str, b.instances)))[:3]
        raise PairingError(
            f"paired arms were scored on different instances ({len(a.instances)} vs "
            f"{len(b.instances)}, e.g. {only or 'the same ones in another order'}); score both "
            "on the same instances"
        )


def shares_seeds(a: ArmSample, b: ArmSample) -> bool:
    """Whether two arms can be paired by seed (their instances are checked when pairing)."""
    return a.seeds == b.seeds


def interval(draws: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates."""
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def difference(a: ArmSample, b: ArmSample, n_boot: int, rng, paired: bool = True) -> dict:
    """a - b: the point estimate, its bootstrap interval, whether it was paired and, when paired,
    the seed-level interval over the per-seed differences (None unpaired: no seed pairs)."""
    low, high = interval(bootstrap_difference(a, b, n_boot, rng, paired))
    seeds = seed_level(seed_differences(a, b)) if paired else None
    return {"delta": a.estimate - b.estimate, "ci": [low, high], "paired": paired,
            "seeds": len(a.seeds), "seed_level": seeds}  # fmt: skip


def seed_differences(a: ArmSample, b: ArmSample) -> list[float]:
    """statistic(a) - statistic(b) within each shared training seed, in a's seed order. Their
    mean is the pooled difference when every seed weighs the same (the same instances and
    weights in each seed, as in every report here)."""
    check_paired(a, b)
    mine, theirs = a.per_seed(), b.per_seed()
    return [mine[s] - theirs[s] for s in a.seeds]


def seed_level(per_seed: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """The mean of per-seed numbers, its t interval (n - 1 degrees of freedom; None for one
    seed) and how many are above and below 0: with three seeds, the bootstrap's percentile
    interval cannot reach beyond the per-seed range, and this one can."""
    from scipy import stats

    bad = LongctxError(
        f"per-seed values {str(per_seed)[:80]} are not one or more finite numbers of a "
        "representable spread; pass one finite number per training seed"
    )
    try:
        x = np.asarray(per_seed, dtype=float)
    except (TypeError, ValueError):
        raise bad from None
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise bad
    n, t_ci = len(x), None
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
        mean = float(x.mean())
        if n > 1:
            half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
            t_ci = [mean - half, mean + half]
    if not np.isfinite([mean, *(t_ci or [])]).all():
        raise bad
    return {"mean": mean, "t_ci": t_ci, "n": n,
            "positive": int((x > 0).sum()), "negative": int((x < 0).sum())}  # fmt: skip


def estimate(arm: ArmSample, n_boot: int, rng) -> dict:
    """One arm: the statistic, its interval and the per-seed statistics."""
    low, high = interval(bootstrap(arm, n_boot, rng))
    return {"value": arm.estimate, "ci": [low, high], "seeds": len(arm.seeds)}


def arm_sample(frame, value: str, weight: str | None, instance: Sequence[str], seed="seed"):
    """An :class:`ArmSample` from a tidy frame of one arm (one row per seed and instance; rows
    of one (seed, instance) are summed): instances sorted by their key, so two arms scored on the
    same instances line up."""
    columns = [seed, *instance]
    rows = frame[columns + [value] + ([weight] if weight else [])]
    sums = rows.groupby(columns, sort=True).sum(numeric_only=True)
    values = sums[value].unstack(seed)
    if values.isna().any().any():
        missing = values.columns[values.isna().any()].tolist()
        raise PairingError(
            f"training seeds {missing} lack some instances the other seeds have; score every "
            "seed on the same instances"
        )
    weights = sums[weight].unstack(seed).to_numpy().T if weight else None
    keys = [k if isinstance(k, tuple) else (k,) for k in values.index]
    return ArmSample.of(values.to_numpy().T, weights, values.columns.tolist(), keys)


def write_per_instance(frame, path) -> None:
    """A report's per-instance rows as gzip CSV, byte-identical for identical rows (no time
    stamp in the gzip header), so a committed file changes only when its numbers do."""
    frame.to_csv(path, index=False, compression={"method": "gzip", "mtime": 0})


def seed_level_text(row: dict, spec: str = "+.4f") -> str:
    """A difference's seed-level interval and sign count for a report's table ("n/a" where the
    arms are unpaired or have one seed)."""
    level = row.get("seed_level")
    if not level or level["t_ci"] is None:
        return "n/a"
    low, high = level["t_ci"]
    return f"[{low:{spec}}, {high:{spec}}] ({level['positive']}+ {level['negative']}−)"
