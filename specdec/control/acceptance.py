"""Per-tenant, per-proposer acceptance-rate estimation from pooled, decayed counts.

Estimator (Leviathan et al. 2023, §3.1 i.i.d. model; truncated-geometric MLE, anchors.md §2.1):
a speculation step that drafts K tokens and accepts ``a`` of them is a run of ``a`` successes
followed, when ``a < K``, by one observed failure (the rejection); when ``a == K`` the run is
censored (no failure observed). Under i.i.d. per-token acceptance α the likelihood is
``α^Σa · (1 - α)^R`` with R the number of steps that saw a rejection, so

    α̂ = Σa / (Σa + R)

This needs no assumption about K being constant between steps. Steps with K = 0 propose
nothing and carry no information; they are ignored (they neither add counts nor decay them).
Equivalently α̂ is the pooled ratio "accepted draft tokens / draft tokens the verifier actually
looked at" (a rejected token is looked at, tokens after it are not): Σ_j accepted_j / Σ_j reached_j.

Per-position counts are kept too, because measured acceptance is *not* i.i.d.: it decays with
the draft position (anchors.md §2.1). ``reached[j]`` counts steps whose verifier looked at the
draft token at position j (K > j and the first j were accepted); ``accepted[j] / reached[j]`` is
the conditional acceptance at position j.

Drift (windowing): exponential decay with a half-life counted in *speculation steps* (steps with
K > 0) of that key. Before a record of n steps is added, the key's counts are multiplied by
``0.5 ** (n / half_life_steps)``. Counting in steps, not seconds, keeps the estimator
deterministic and makes an idle tenant keep its estimate (no new evidence, nothing to forget);
the effective window is about ``half_life_steps / ln 2`` steps (~289 for the default 200).

Prior (new keys): a key seen for the first time is seeded with pseudo-counts from the global
pool of its proposer (all tenants, decayed with ``global_half_life_steps``):
``prior_weight`` pseudo-trials split as ``w·α_g`` accepted and ``w·(1 - α_g)`` rejections,
where α_g is the global estimate (``default_alpha`` while the global pool is empty). With
``global_prior_weight`` w_g > 0 the global estimate has pseudo-counts of its own,
``(Σa_g + w_g·default_alpha) / (Σa_g + R_g + w_g)``: without them one rejected step of one
tenant makes α_g = 0, and the next tenant starts from ``prior_weight`` pseudo-rejections and
reads α̂ = 0.0 after its own first rejected step. The default is :data:`GLOBAL_PRIOR_WEIGHT`,
in process as served (the controller actor's and the draft replicas' estimators); 0 keeps the
raw pool (tests of the pool's arithmetic). The
pseudo-counts decay with the key's own counts and, in addition, halve every
``prior_half_life_steps`` (default 20) of the key's own K > 0 steps, so the prior fades as the
tenant's data arrives. The extra fade matters for a draft that never agrees: each of its steps
adds only one trial (the rejection), so a prior of 20 pseudo-trials borrowed from well-agreeing
tenants would otherwise hold α̂ near 0.25 for about sixty steps.

Not thread-safe: one owner (a single event loop, or one Ray actor) calls it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Hashable, Mapping, Sequence

#: Key of one estimate: (tenant id, proposer name).
Key = tuple[str, str]
#: Pseudo-trials at ``default_alpha`` of the global estimate in the served estimators (module
#: docstring): one rejected step in an empty pool reads 10 / 21, not 0.
GLOBAL_PRIOR_WEIGHT = 20.0


def reached_from_counts(accepted_per_position: Sequence[float], proposed_per_position: Sequence[float]) -> list[float]:
    """Steps whose verifier looked at each draft position j: ``proposed[0]`` for j = 0, else
    ``min(proposed[j], accepted[j - 1])`` (exact when every block of the counts had the same
    length; an upper bound with blocks of different lengths, so the acceptance it gives is then
    conservative)."""
    prop = list(proposed_per_position)
    acc = list(accepted_per_position) + [0] * max(0, len(prop) - len(accepted_per_position))
    return [prop[0]] + [min(prop[j], acc[j - 1]) for j in range(1, len(prop))] if prop else []


def shrunk_position_alphas(accepted: Sequence[float], reached: Sequence[float], alpha: float, n: int,
                           prior_trials: float) -> list[float]:
    """Per-position acceptance α_0..α_{n-1} that keeps the first draft position apart from the run.

    Measured acceptance is clustered: the draft is wrong in hard stretches of the text, so the
    first token of a block (often right after a rejection, in the same stretch) is accepted less
    often than a later one (whose predecessor was just accepted). The pooled truncated-geometric
    α̂ mixes the two in proportions set by the K it was measured at, so an α̂ learned at a short K
    undervalues a long one (two blocks of K = 3 per hard stretch read α̂ = 3·0.67 / (3·0.67 + 0.33)
    = 0.86 where the same text read at K = 8 gives 0.94). Here (all counts decayed, no prior):

        r   = (Σ_{j≥1} a_j + w·α) / (Σ_{j≥1} reached_j + w)        the run rate, positions ≥ 1
        α_0 = (a_0 + w·α) / (reached_0 + w)
        α_j = (a_j + w·r) / (reached_j + w)                          (j ≥ 1)

    with w = ``prior_trials``: a position with few trials stays near the run rate (or α for
    position 0), a position never reached takes it, and with i.i.d. acceptance every α_j tends
    to α. E[N(k)] = 1 + Σ_{j<k} Π_{i≤j} α_i
    (:func:`specdec.control.objective.expected_tokens_per_step_positional`).

    Args:
        accepted, reached: per-position counts (index = draft position, 0-based; reached from
            :func:`reached_from_counts`); missing positions count 0.
        alpha: the pooled estimate to shrink towards (α̂ with its prior), in [0, 1].
        n: positions wanted (the largest K considered).
        prior_trials: w > 0.

    Raises:
        ValueError: ``alpha`` outside [0, 1], ``n < 0``, ``prior_trials <= 0``, a negative count,
            or more accepted than reached at a position.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if n < 0 or not prior_trials > 0:
        raise ValueError(f"need n >= 0 and prior_trials > 0, got n={n}, prior_trials={prior_trials}")
    a = [float(x) for x in accepted]
    r = [float(x) for x in reached]
    m = max(len(a), len(r))
    a += [0.0] * (m - len(a))
    r += [0.0] * (m - len(r))
    for j in range(m):
        if a[j] < 0 or r[j] < 0 or a[j] > r[j] + 1e-9:
            raise ValueError(f"position {j}: need 0 <= accepted <= reached, got {a[j]} > {r[j]}")
    w = float(prior_trials)
    run = (sum(a[1:]) + w * alpha) / (sum(r[1:]) + w)
    out = []
    for j in range(n):
        centre = alpha if j == 0 else run
        aj, rj = (a[j], r[j]) if j < m else (0.0, 0.0)
        out.append((aj + w * centre) / (rj + w))
    return out


@dataclass
class _Counts:
    """Decayed counts (floats because of decay). ``prior_*`` are pseudo-counts."""

    accepted: float = 0.0
    rejected_steps: float = 0.0
    steps: float = 0.0
    proposed: float = 0.0
    prior_accepted: float = 0.0
    prior_rejected: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)
    reached_per_position: list[float] = field(default_factory=list)
    proposed_per_position: list[float] = field(default_factory=list)
    raw_steps: int = 0  # undecayed number of K > 0 steps ever recorded

    def decay(self, factor: float) -> None:
        if factor == 1.0:
            return
        self.accepted *= factor
        self.rejected_steps *= factor
        self.steps *= factor
        self.proposed *= factor
        self.prior_accepted *= factor
        self.prior_rejected *= factor
        for lst in (self.accepted_per_position, self.reached_per_position, self.proposed_per_position):
            for j in range(len(lst)):
                lst[j] *= factor

    def grow(self, n: int) -> None:
        for lst in (self.accepted_per_position, self.reached_per_position, self.proposed_per_position):
            while len(lst) < n:
                lst.append(0.0)

    def alpha(self) -> float | None:
        num = self.accepted + self.prior_accepted
        den = num + self.rejected_steps + self.prior_rejected
        return num / den if den > 0 else None

    def to_dict(self) -> dict:
        """Plain data (JSON-safe): every field by name."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "_Counts":
        """Inverse of :meth:`to_dict`. Fields missing from ``d`` (written before they existed)
        take their defaults; unknown names are ignored.

        Raises:
            ValueError, TypeError: a value that is not a finite non-negative number (or list of them).
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"counts must be a mapping, got {type(d).__name__}")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "raw_steps":
                kw[f.name] = _count(v, f.name)
            elif f.name.endswith("_per_position"):
                if not isinstance(v, (list, tuple)):
                    raise TypeError(f"{f.name} must be a list, got {type(v).__name__}")
                kw[f.name] = [_number(x, f.name) for x in v]
            else:
                kw[f.name] = _number(v, f.name)
        return cls(**kw)


def _number(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
    return float(v)


def _count(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class AcceptanceSnapshot:
    """The counts behind one key's estimate (plain data; decayed counts are floats).

    Attributes:
        key: (tenant, proposer).
        alpha: α̂ including the prior pseudo-counts.
        accepted: Σa, decayed accepted draft tokens (observed only).
        rejected_steps: decayed number of steps with a rejection (a < K).
        steps: decayed number of K > 0 steps.
        proposed: decayed number of drafted tokens.
        prior_accepted, prior_rejected: remaining (decayed) pseudo-counts of the prior.
        raw_steps: K > 0 steps ever recorded, undecayed.
        accepted_per_position, reached_per_position, proposed_per_position: decayed counts per
            draft position j (0-based).
        position_alphas: accepted_j / reached_j per position (None where nothing reached it).
    """

    key: tuple
    alpha: float
    accepted: float
    rejected_steps: float
    steps: float
    proposed: float
    prior_accepted: float
    prior_rejected: float
    raw_steps: int
    accepted_per_position: tuple[float, ...]
    reached_per_position: tuple[float, ...]
    proposed_per_position: tuple[float, ...]
    position_alphas: tuple[float | None, ...]

    @property
    def evidence(self) -> float:
        """Observed trials behind α̂ (Σa + R, decayed), prior excluded."""
        return self.accepted + self.rejected_steps

    def as_dict(self) -> dict:
        return {
            "tenant": self.key[0],
            "proposer": self.key[1],
            "alpha": self.alpha,
            "accepted": self.accepted,
            "rejected_steps": self.rejected_steps,
            "steps": self.steps,
            "proposed": self.proposed,
            "prior_accepted": self.prior_accepted,
            "prior_rejected": self.prior_rejected,
            "raw_steps": self.raw_steps,
            "evidence": self.evidence,
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "proposed_per_position": list(self.proposed_per_position),
            "position_alphas": list(self.position_alphas),
        }


class AcceptanceEstimator:
    """Pooled, exponentially decayed acceptance counts per (tenant, proposer).

    Args:
        half_life_steps: half-life of a key's counts, in K > 0 speculation steps of that key;
            None disables decay (exact pooled counts, used by tests).
        global_half_life_steps: half-life of each proposer's global pool, in steps of all
            tenants; None disables decay.
        prior_weight: pseudo-trials (accepted + rejections) a new key gets from the global pool.
        default_alpha: the global estimate while a proposer's global pool has no data.
        prior_half_life_steps: extra half-life of a key's prior pseudo-counts, in the key's own
            K > 0 steps; None: the prior decays only with the key's counts.
        global_prior_weight: pseudo-trials at ``default_alpha`` in each proposer's global
            estimate (:meth:`global_alpha`; default :data:`GLOBAL_PRIOR_WEIGHT`; 0: the raw pool).

    Raises:
        ValueError: a half-life that is not > 0, a negative weight, ``default_alpha`` outside [0, 1].
    """

    def __init__(
        self,
        *,
        half_life_steps: float | None = 200.0,
        global_half_life_steps: float | None = 2000.0,
        prior_weight: float = 20.0,
        default_alpha: float = 0.5,
        prior_half_life_steps: float | None = 20.0,
        global_prior_weight: float = GLOBAL_PRIOR_WEIGHT,
    ):
        for name, v in (("half_life_steps", half_life_steps), ("global_half_life_steps", global_half_life_steps)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        if not global_prior_weight >= 0:
            raise ValueError(f"global_prior_weight must be >= 0, got {global_prior_weight}")
        self.global_prior_weight = float(global_prior_weight)
        if not 0.0 <= default_alpha <= 1.0:
            raise ValueError(f"default_alpha must be in [0, 1], got {default_alpha}")
        self.half_life_steps = half_life_steps
        self.global_half_life_steps = global_half_life_steps
        self.prior_weight = float(prior_weight)
        self.default_alpha = float(default_alpha)
        if prior_half_life_steps is not None and not prior_half_life_steps > 0:
            raise ValueError(f"prior_half_life_steps must be > 0 or None, got {prior_half_life_steps}")
        self.prior_half_life_steps = prior_half_life_steps
        self._keys: dict[Hashable, _Counts] = {}
        self._global: dict[str, _Counts] = {}

    # ---------------------------------------------------------------- recording

    def record(self, key: Key, k: int, accepted: int) -> None:
        """Record one speculation step that drafted ``k`` tokens and accepted ``accepted``.

        ``k == 0`` is ignored (plain decoding: no acceptance signal).
        """
        if k < 0 or not 0 <= accepted <= k:
            raise ValueError(f"need 0 <= accepted <= k, got k={k}, accepted={accepted}")
        if k == 0:
            return
        reached = [0] * k
        acc = [0] * k
        for j in range(min(accepted + 1, k)):
            reached[j] = 1
        for j in range(accepted):
            acc[j] = 1
        self._add(key, accepted, 1 if accepted < k else 0, 1, k, acc, reached, [1] * k)

    def record_counts(
        self,
        key: Key,
        *,
        accepted: int,
        rejected_steps: int,
        spec_steps: int,
        proposed: int | None = None,
        accepted_per_position: Sequence[int] | None = None,
        proposed_per_position: Sequence[int] | None = None,
    ) -> None:
        """Record a whole request's counters at once (see :class:`specdec.types.SpeculationStats`).

        Args:
            accepted: Σa over the request's steps.
            rejected_steps: steps with a rejection (a < K).
            spec_steps: steps with K > 0 (what the decay counts; ``stats.steps`` minus the K = 0
                steps).
            proposed: drafted tokens (defaults to Σ proposed_per_position).
            accepted_per_position, proposed_per_position: per-position counts. The number of
                steps that *reached* position j is taken as ``min(proposed[j], accepted[j-1])``
                (``proposed[0]`` for j = 0): exact when K was constant within the request
                (the controller picks K per request), an upper bound otherwise.

        The request's steps are added together after one decay of ``spec_steps`` steps; they
        are not decayed among themselves.
        """
        if accepted < 0 or rejected_steps < 0 or spec_steps < 0:
            raise ValueError("counts must be >= 0")
        if rejected_steps > spec_steps:
            raise ValueError(f"rejected_steps={rejected_steps} > spec_steps={spec_steps}")
        acc_pos = list(accepted_per_position or [])
        prop_pos = list(proposed_per_position or [])
        if len(acc_pos) > len(prop_pos):
            raise ValueError("accepted_per_position is longer than proposed_per_position")
        acc_pos += [0] * (len(prop_pos) - len(acc_pos))
        if any(a > p for a, p in zip(acc_pos, prop_pos)):
            raise ValueError("accepted_per_position exceeds proposed_per_position")
        if prop_pos and sum(acc_pos) != accepted:
            raise ValueError(f"sum(accepted_per_position)={sum(acc_pos)} != accepted={accepted}")
        reached = [prop_pos[0]] if prop_pos else []
        for j in range(1, len(prop_pos)):
            reached.append(min(prop_pos[j], acc_pos[j - 1]))
        if proposed is None:
            proposed = sum(prop_pos)
        if spec_steps == 0:
            if accepted or proposed:
                raise ValueError("accepted/proposed tokens without any K > 0 step")
            return
        self._add(key, accepted, rejected_steps, spec_steps, proposed, acc_pos, reached, prop_pos)

    def record_stats(self, key: Key, stats) -> None:
        """Record a :class:`specdec.types.SpeculationStats` (or its ``as_dict()``)."""
        d = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)
        k_counts = {int(k): int(v) for k, v in (d.get("k_counts") or {}).items()}
        self.record_counts(
            key,
            accepted=int(d["accepted"]),
            rejected_steps=int(d["rejected_steps"]),
            spec_steps=int(d["steps"]) - k_counts.get(0, 0),
            proposed=int(d["proposed"]),
            accepted_per_position=d.get("accepted_per_position"),
            proposed_per_position=d.get("proposed_per_position"),
        )

    def _add(self, key, accepted, rejected, steps, proposed, acc_pos, reached, prop_pos) -> None:
        c = self._keys.get(key)
        if c is None:
            c = self._new_key(key)
        g = self._global.setdefault(self._proposer(key), _Counts())
        if self.prior_half_life_steps is not None:
            fade = 0.5 ** (steps / self.prior_half_life_steps)
            c.prior_accepted *= fade
            c.prior_rejected *= fade
        for counts, hl in ((c, self.half_life_steps), (g, self.global_half_life_steps)):
            counts.decay(1.0 if hl is None else 0.5 ** (steps / hl))
            counts.accepted += accepted
            counts.rejected_steps += rejected
            counts.steps += steps
            counts.proposed += proposed
            counts.raw_steps += steps
            counts.grow(len(prop_pos))
            for j in range(len(prop_pos)):
                counts.accepted_per_position[j] += acc_pos[j]
                counts.reached_per_position[j] += reached[j]
                counts.proposed_per_position[j] += prop_pos[j]

    def _new_key(self, key) -> _Counts:
        a_g = self.global_alpha(self._proposer(key))
        c = _Counts(prior_accepted=self.prior_weight * a_g, prior_rejected=self.prior_weight * (1.0 - a_g))
        self._keys[key] = c
        return c

    @staticmethod
    def _proposer(key) -> str:
        return key[1] if isinstance(key, tuple) and len(key) >= 2 else ""

    # ---------------------------------------------------------------- reading

    def global_alpha(self, proposer: str) -> float:
        """The pooled estimate over all tenants of ``proposer``: ``(Σa + w_g·d) / (Σa + R + w_g)``
        with w_g = ``global_prior_weight``, d = ``default_alpha`` (``default_alpha`` if nothing)."""
        g = self._global.get(proposer)
        acc, rej = (g.accepted, g.rejected_steps) if g is not None else (0.0, 0.0)
        w = self.global_prior_weight
        den = acc + rej + w
        return self.default_alpha if den <= 0 else (acc + w * self.default_alpha) / den

    def alpha(self, key: Key) -> float:
        """α̂ for ``key``: its decayed counts plus prior; the global estimate for unseen keys."""
        c = self._keys.get(key)
        a = c.alpha() if c is not None else None
        return self.global_alpha(self._proposer(key)) if a is None else a

    def evidence(self, key: Key) -> float:
        """Observed (decayed) trials Σa + R behind ``alpha(key)``; 0 for unseen keys."""
        c = self._keys.get(key)
        return 0.0 if c is None else c.accepted + c.rejected_steps

    def upper_alpha(self, key: Key, z: float = 1.0) -> float:
        """An optimistic acceptance for ``key``: the larger of :meth:`alpha` and an upper
        confidence bound on its own (decayed) evidence alone, ``m + z·sd`` of the Beta(Σa + 1,
        R + 1) posterior (mean ``m = (Σa + 1) / (n + 2)``, ``sd = sqrt(m (1 - m) / (n + 3))``,
        n = Σa + R trials; at most 1). With no evidence the bound is 0.5 + 0.289·z; it tightens
        as trials arrive (at z = 1: 0.944 + 0.053 after 4 steps of 4 accepted drafts, 0.083 +
        0.077 after 10 steps whose first draft was rejected), so it is optimism under uncertainty, not a second estimate: a choice
        made on it runs the K whose acceptance is plausible and measures it, where a choice on
        the prior-weighted :meth:`alpha` alone holds K = 0, which measures nothing
        (:class:`specdec.control.batch_controller.BatchKController`, "Optimism").

        Raises:
            ValueError: ``z < 0``.
        """
        if not z >= 0:
            raise ValueError(f"z must be >= 0, got {z}")
        c = self._keys.get(key)
        acc, rej = (c.accepted, c.rejected_steps) if c is not None else (0.0, 0.0)
        n = acc + rej
        m = (acc + 1.0) / (n + 2.0)
        return max(self.alpha(key), min(1.0, m + z * math.sqrt(m * (1.0 - m) / (n + 3.0))))

    def position_alphas(self, key: Key, min_reached: float = 30.0) -> list[float]:
        """Conditional acceptance per draft position, accepted_j / reached_j.

        Returns the leading positions j = 0, 1, ... whose decayed ``reached_j`` is at least
        ``min_reached``, stopping at the first position with less (later positions are at most
        as well sampled). Empty for unseen keys. No prior is applied per position.
        """
        c = self._keys.get(key)
        out: list[float] = []
        if c is None:
            return out
        for a, r in zip(c.accepted_per_position, c.reached_per_position):
            if r < min_reached or r <= 0:
                break
            out.append(a / r)
        return out

    def shrunk_position_alphas(self, key: Key, n: int, prior_trials: float,
                               extra_accepted: Sequence[float] = (), extra_reached: Sequence[float] = (),
                               alpha: float | None = None, scale: float = 1.0) -> list[float]:
        """Acceptance at draft positions 0..n-1 for a run-aware E[N(k)]: :func:`shrunk_position_alphas`
        over ``key``'s decayed per-position counts times ``scale`` (in [0, 1]) plus ``extra_*``
        (a running request's own counts, same indexing), shrunk towards ``alpha`` (default
        :meth:`alpha`) with ``prior_trials`` pseudo-trials. Empty for ``n = 0``.

        Raises:
            ValueError: ``scale`` outside [0, 1] (and as :func:`shrunk_position_alphas`).
        """
        if not 0.0 <= scale <= 1.0:
            raise ValueError(f"scale must be in [0, 1], got {scale}")
        c = self._keys.get(key)
        acc = [x * scale for x in c.accepted_per_position] if c is not None else []
        reached = [x * scale for x in c.reached_per_position] if c is not None else []
        for lst, extra in ((acc, extra_accepted), (reached, extra_reached)):
            while len(lst) < len(extra):
                lst.append(0.0)
            for j, x in enumerate(extra):
                lst[j] += float(x)
        return shrunk_position_alphas(acc, reached, self.alpha(key) if alpha is None else alpha, n, prior_trials)

    def snapshot(self, key: Key) -> AcceptanceSnapshot:
        """Counts and estimates for ``key`` (all zero, α = global, for an unseen key)."""
        c = self._keys.get(key) or _Counts()
        pos = tuple(a / r if r > 0 else None for a, r in zip(c.accepted_per_position, c.reached_per_position))
        return AcceptanceSnapshot(
            key=tuple(key),
            alpha=self.alpha(key),
            accepted=c.accepted,
            rejected_steps=c.rejected_steps,
            steps=c.steps,
            proposed=c.proposed,
            prior_accepted=c.prior_accepted,
            prior_rejected=c.prior_rejected,
            raw_steps=c.raw_steps,
            accepted_per_position=tuple(c.accepted_per_position),
            reached_per_position=tuple(c.reached_per_position),
            proposed_per_position=tuple(c.proposed_per_position),
            position_alphas=pos,
        )

    def discount(self, key: Key, factor: float) -> None:
        """Multiply ``key``'s counts (prior included) by ``factor`` in [0, 1]: old evidence
        weighs less against what is recorded next; α̂ itself is unchanged."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"factor must be in [0, 1], got {factor}")
        c = self._keys.get(key)
        if c is not None:
            c.decay(factor)

    def cap_evidence(self, key: Key, trials: float) -> None:
        """Scale ``key``'s counts (prior included) so that they hold at most ``trials``
        trials (accepted + rejections); α̂ itself is unchanged.

        Used before a probe's counts are recorded (:mod:`specdec.control.batch_k`,
        :class:`specdec.control.controller.KController`): the old counts predate the time at
        K = 0, so whatever their size they then weigh as ``trials`` trials against the probe's,
        and a probe of a few steps moves α̂ most of the way to what it measured.

        Raises:
            ValueError: ``trials < 0``.
        """
        if not trials >= 0:
            raise ValueError(f"trials must be >= 0, got {trials}")
        c = self._keys.get(key)
        if c is None:
            return
        total = c.accepted + c.rejected_steps + c.prior_accepted + c.prior_rejected
        if total > trials:
            c.decay(trials / total)

    def export_counts(self) -> dict:
        """The learned counts as plain data (JSON-safe): ``{"keys": [[tenant, proposer,
        counts], ...], "global": {proposer: counts}}``. Settings (half-lives, prior) are not
        included: they belong to the constructor."""
        return {
            "keys": [[str(k[0]), str(k[1]), c.to_dict()] for k, c in self._keys.items()],
            "global": {str(p): c.to_dict() for p, c in self._global.items()},
        }

    def import_counts(self, data: Mapping[str, Any]) -> None:
        """Replace the learned counts with :meth:`export_counts`'s ``data``; all or nothing.

        Raises:
            ValueError, TypeError, KeyError: ``data`` is not of that shape.
        """
        keys: dict[Hashable, _Counts] = {}
        for entry in data["keys"]:
            tenant, proposer, counts = entry
            if not isinstance(tenant, str) or not isinstance(proposer, str):
                raise TypeError(f"key must be two strings, got {tenant!r}, {proposer!r}")
            keys[(tenant, proposer)] = _Counts.from_dict(counts)
        glob = {}
        for p, counts in dict(data["global"]).items():
            glob[str(p)] = _Counts.from_dict(counts)
        self._keys, self._global = keys, glob

    def keys(self) -> list:
        """Keys with recorded data."""
        return list(self._keys)

    def raw_steps(self, key: Key) -> int:
        """K > 0 steps ever recorded for ``key`` (undecayed; 0 for unseen keys)."""
        c = self._keys.get(key)
        return 0 if c is None else c.raw_steps

    def set_counts(self, key: Key, counts: Mapping[str, Any]) -> None:
        """Replace ``key``'s counts with ``counts`` (one entry of :meth:`export_counts`' ``keys``).

        Raises:
            ValueError, TypeError: ``counts`` is not of that shape.
        """
        self._keys[key] = _Counts.from_dict(counts)

    def set_global(self, proposer: str, counts: Mapping[str, Any]) -> None:
        """Replace the global pool of ``proposer`` (the prior of new keys) with ``counts``.

        Raises:
            ValueError, TypeError: ``counts`` is not of that shape.
        """
        self._global[str(proposer)] = _Counts.from_dict(counts)
