"""Response-length distributions of the model-free engine: pure, seeded, unit-testable.

Why these shapes: rollout scheduling is decided by the long tail of response lengths (design.md:
"p99 > 10x median"), so the emulated engine must reproduce the tail, not just the mean. Each
distribution is a pydantic model (a discriminated union on ``kind``, so a YAML picks one) with

* ``sample(rng, n)`` — ``n`` integer lengths (numpy int64) from a ``numpy.random.Generator``;
* ``quantile(q)`` — the continuous quantile, analytic where possible (bisection for mixtures).
  Samples are that continuous variable rounded to the nearest integer and then bounded, so an
  empirical quantile is within 1 token of ``quantile`` up to sampling error.

Kinds:

* ``fixed`` — always ``value`` (tests).
* ``lognormal`` — ``median * exp(sigma * Z)``.
* ``longtail`` — a lognormal parameterised by its ``median`` and ``p99_ratio`` = p99 / median
  (default 10, the paper's figure): ``sigma = ln(p99_ratio) / z_0.99 = ln 10 / 2.3263 = 0.990``.
* ``mixture`` — a weighted mixture of lognormal components.
* ``paper`` — the bimodal 7B-math shape of the paper's Fig. 17: 75% ``lognormal(median 1024,
  sigma 0.5)`` (density peak ~800 tokens, log-space mode 1K) + 25% ``lognormal(median 8192,
  sigma 0.35)`` (peak ~7.2K, log-space mode 8K), bounded at 16384. Its median is ~1.27K and its
  p99 ~15.1K (~12x the median); ~0.6% of responses reach the 16K bound.
* ``quantiles`` — an empirical distribution given by (probability, length) points from q=0 to
  q=1, linearly interpolated (inverse-transform sampling): paste a measured CDF here.

Bounds (all kinds but ``fixed``): ``min_length`` (default 1) and ``max_length`` (default none)
*clip* rather than truncate — a response that would run past the bound ends at it, like a model
hitting its generation limit — so ``quantile`` is simply the bounded raw quantile.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from itertools import pairwise
from statistics import NormalDist
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from laminar.runtime.config import Strict

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "FixedLength",
    "LengthDistribution",
    "LognormalComponent",
    "LognormalLength",
    "LongtailLength",
    "MixtureLength",
    "PaperLength",
    "QuantilesLength",
]

_NORMAL = NormalDist()
Z99 = _NORMAL.inv_cdf(0.99)  # 2.3263...


def _z(q: float) -> float:
    """The standard normal quantile, with the endpoints at +-inf."""
    if q <= 0.0:
        return -math.inf
    if q >= 1.0:
        return math.inf
    return _NORMAL.inv_cdf(q)


def _check_q(q: float) -> None:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must be in [0, 1], got {q}")


class _Distribution(Strict):
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def quantile(self, q: float) -> float:
        raise NotImplementedError


class FixedLength(_Distribution):
    """Every response is ``value`` tokens."""

    kind: Literal["fixed"] = Field("fixed", description="Selects this distribution.")
    value: Annotated[int, Field(ge=1)] = Field(256, description="The length, in tokens.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        return np.full(n, self.value, dtype=np.int64)

    def quantile(self, q: float) -> float:
        _check_q(q)
        return float(self.value)


class _Bounded(_Distribution):
    """A continuous distribution, rounded to integers and clipped to [min_length, max_length]."""

    min_length: Annotated[int, Field(ge=1)] = Field(
        1, description="Shorter samples are raised to it."
    )
    max_length: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Longer samples are cut to it; null = unbounded."
    )

    @model_validator(mode="after")
    def _ordered_bounds(self) -> _Bounded:
        if self.max_length is not None and self.max_length < self.min_length:
            raise ValueError(f"max_length {self.max_length} < min_length {self.min_length}")
        return self

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def _raw_quantile(self, q: float) -> float:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        hi = math.inf if self.max_length is None else float(self.max_length)
        x = np.clip(np.rint(self._raw_sample(rng, n)), float(self.min_length), hi)
        return x.astype(np.int64)

    def quantile(self, q: float) -> float:
        _check_q(q)
        v = max(float(self.min_length), self._raw_quantile(q))
        return v if self.max_length is None else min(v, float(self.max_length))


class LognormalLength(_Bounded):
    """``median * exp(sigma * Z)``: quantile ``median * exp(sigma * z_q)``."""

    kind: Literal["lognormal"] = Field("lognormal", description="Selects this distribution.")
    median: Annotated[float, Field(gt=0)] = Field(1024.0, description="Median length (tokens).")
    sigma: Annotated[float, Field(ge=0)] = Field(1.0, description="Std. dev. of log(length).")

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(math.log(self.median), self.sigma, n)

    def _raw_quantile(self, q: float) -> float:
        if self.sigma == 0:
            return self.median
        return self.median * math.exp(self.sigma * _z(q))


class LongtailLength(_Bounded):
    """A lognormal with p99 = ``p99_ratio`` x median (default 10: the paper's long tail)."""

    kind: Literal["longtail"] = Field("longtail", description="Selects this distribution.")
    median: Annotated[float, Field(gt=0)] = Field(1024.0, description="Median length (tokens).")
    p99_ratio: Annotated[float, Field(gt=1)] = Field(10.0, description="p99 / median.")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_ratio) / Z99

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.lognormal(math.log(self.median), self.sigma, n)

    def _raw_quantile(self, q: float) -> float:
        return self.median * math.exp(self.sigma * _z(q))


class LognormalComponent(Strict):
    weight: Annotated[float, Field(gt=0)] = Field(
        1.0, description="Relative weight, normalised over the components."
    )
    median: Annotated[float, Field(gt=0)] = Field(description="Median length (tokens).")
    sigma: Annotated[float, Field(ge=0)] = Field(description="Std. dev. of log(length).")


def _mixture_sample(
    rng: np.random.Generator, n: int, components: list[LognormalComponent]
) -> np.ndarray:
    import numpy as np

    weights = np.array([c.weight for c in components], dtype=float)
    which = rng.choice(len(components), size=n, p=weights / weights.sum())
    mu = np.log([c.median for c in components])[which]
    sigma = np.array([c.sigma for c in components])[which]
    return np.exp(mu + sigma * rng.standard_normal(n))


def _mixture_quantile(q: float, components: list[LognormalComponent]) -> float:
    """Invert the mixture CDF by bisection on log(length) (to ~1e-12 relative)."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return math.inf
    total = sum(c.weight for c in components)

    def cdf(log_x: float) -> float:
        acc = 0.0
        for c in components:
            d = log_x - math.log(c.median)
            if c.sigma == 0:
                acc += c.weight * (1.0 if d >= 0 else 0.0)
            else:
                acc += c.weight * _NORMAL.cdf(d / c.sigma)
        return acc / total

    lo = min(math.log(c.median) - 40 * c.sigma for c in components) - 1.0
    hi = max(math.log(c.median) + 40 * c.sigma for c in components) + 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < q:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


class MixtureLength(_Bounded):
    """A weighted mixture of lognormals; the quantile is found by bisection on the CDF."""

    kind: Literal["mixture"] = Field("mixture", description="Selects this distribution.")
    components: list[LognormalComponent] = Field(
        min_length=1, description="The lognormal components."
    )

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _mixture_sample(rng, n, self.components)

    def _raw_quantile(self, q: float) -> float:
        return _mixture_quantile(q, self.components)


class PaperLength(_Bounded):
    """The paper's bimodal 7B-math lengths (Fig. 17): modes near 1K and 8K, tail to 16K."""

    kind: Literal["paper"] = Field("paper", description="Selects this distribution.")
    short_median: Annotated[float, Field(gt=0)] = Field(
        1024.0, description="Median of the short mode (tokens)."
    )
    short_sigma: Annotated[float, Field(ge=0)] = Field(
        0.5, description="Std. dev. of log(length) of the short mode."
    )
    long_median: Annotated[float, Field(gt=0)] = Field(
        8192.0, description="Median of the long mode (tokens)."
    )
    long_sigma: Annotated[float, Field(ge=0)] = Field(
        0.35, description="Std. dev. of log(length) of the long mode."
    )
    long_weight: Annotated[float, Field(gt=0, lt=1)] = Field(
        0.25, description="Share of responses from the long mode."
    )
    max_length: Annotated[int, Field(ge=1)] | None = Field(
        16384, description="Longer samples are cut to it; null = unbounded."
    )

    def components(self) -> list[LognormalComponent]:
        return [
            LognormalComponent(
                weight=1 - self.long_weight, median=self.short_median, sigma=self.short_sigma
            ),
            LognormalComponent(
                weight=self.long_weight, median=self.long_median, sigma=self.long_sigma
            ),
        ]

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _mixture_sample(rng, n, self.components())

    def _raw_quantile(self, q: float) -> float:
        return _mixture_quantile(q, self.components())


class QuantilesLength(_Bounded):
    """An empirical distribution: (probability, length) points, linear in between."""

    kind: Literal["quantiles"] = Field("quantiles", description="Selects this distribution.")
    points: list[tuple[float, Annotated[float, Field(ge=0)]]] = Field(
        description="(q, length) from q=0 to q=1: q strictly increasing, lengths non-decreasing."
    )

    @model_validator(mode="after")
    def _valid_cdf(self) -> QuantilesLength:
        qs = [q for q, _ in self.points]
        vs = [v for _, v in self.points]
        if len(qs) < 2 or qs[0] != 0.0 or qs[-1] != 1.0:
            raise ValueError("quantile points must run from q=0 to q=1 (at least two points)")
        if any(b <= a for a, b in pairwise(qs)):
            raise ValueError(f"quantile levels must increase strictly, got {qs}")
        if any(b < a for a, b in pairwise(vs)):
            raise ValueError(f"quantile lengths must not decrease, got {vs}")
        return self

    def _raw_sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        import numpy as np

        qs, vs = zip(*self.points, strict=True)
        return np.interp(rng.random(n), qs, vs)

    def _raw_quantile(self, q: float) -> float:
        qs = [p for p, _ in self.points]
        i = min(bisect_right(qs, q), len(qs) - 1)
        (q0, v0), (q1, v1) = self.points[i - 1], self.points[i]
        return v0 + (v1 - v0) * (q - q0) / (q1 - q0)


LengthDistribution = Annotated[
    FixedLength | LognormalLength | LongtailLength | MixtureLength | PaperLength | QuantilesLength,
    Field(discriminator="kind"),
]
