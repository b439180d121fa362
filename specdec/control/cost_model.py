"""Run-time cost model of one speculation step, in seconds.

A step with K = k > 0 costs (Leviathan et al. 2023, §3.3, with their constant c replaced by
measured terms; anchors.md §2.1 "c = (T_draft·γ + RTT)/(γ·T_target) in effect"):

    step_time(k) = draft_block_s(k) + verify_s(k + 1) + round_trip_s

(``draft_block_s(k) = k · draft_s_per_token`` until blocks were measured by length, below)

and K = 0 (plain decoding) costs ``verify_s(1)``: one target forward of one position, no draft,
no round trip.

- ``draft_s_per_token``: proposer compute per drafted token (an EWMA of seconds / k).
- ``verify_s(p)``: target scoring of p positions plus verification. Kept as one EWMA per p
  because the curve is hardware-specific and need not be monotonic (measured on one box:
  K=1 0.37 s, K=2 0.70 s, K=3 1.02 s, K=4 0.68 s: a different kernel path). Unseen p are
  interpolated linearly between the nearest measured sizes; above the measured range they are
  extrapolated with the least-squares slope of the measured points, clamped at >= 0 (never
  cheaper for more positions), and below it with the same slope, at most ``t_lo / p_lo`` so
  the value stays positive (``extrapolation="trend"``, the default). With a single measured
  size the prior's shape is scaled through it. ``extrapolation="monotone"`` (the batch cost
  model's, :class:`specdec.control.batch_k.BatchCostModel`, whose smallest measured forward may
  be a prompt's prefill, whose trend says nothing about a decode forward) is never flat below
  and never drops above: below the smallest measured size on the line through the origin,
  ``t_lo · p / p_lo``; above the largest from the dearest measured size, ``max_t + slope · (p - p_hi)`` with the
  least-squares slope clamped at >= 0 (the prior's relative slope with a single point).
- ``draft_block_s(d)``: the draft's seconds for a block of d drafted tokens, when blocks were
  measured by length (:meth:`CostModel.observe_draft_block`; in process,
  :class:`specdec.control.adaptive.StepCosts`): d forwards, the first of which also feeds the
  tokens committed since the last block (the bonus token, and after a fully accepted block the
  last drafted one) and re-syncs the draft cache, so it costs more than each later one-token
  forward (s11 EPYC, w8a8 pair, code-prime 32 tokens: first ~40-46 ms, later ~21-26 ms;
  ``docs/bench/formats/bench-s12/costk12/``). Hence ``draft_block_s(d) = first + (d - 1) ·
  later``: measured lengths as measured (one EWMA per d), other lengths interpolated between
  the nearest measured ones, beyond them on the least-squares line through the measured means
  (its slope, clamped at >= 0, is the later forward); with a single measured length d0 the
  split is the prior's, ``first = prior_draft_first_ratio · later``. Until a block was measured
  by length, ``d · draft_s_per_token`` (the per-token EWMA, or its prior) as before: the served
  path, whose draft replica reports draft seconds per drafted token only, is unchanged.
- ``draft_prefill_s``: the draft's prompt prefill, once per request that speculates
  (:meth:`CostModel.observe_draft_prefill`; 8-20 % of a 32-token request on the s11 EPYC, none
  at K = 0). Not part of a step: :meth:`CostModel.request_speedup` spreads it over a request's
  steps.
- ``round_trip_s``: draft↔target transport per step (serialization, RPC), measured separately
  by the caller. If a caller cannot separate it, it lands in the draft figure (amortized per
  token, so slightly mis-scaled when K changes).

EWMA: the first n observations are a plain running mean while 1/n > ``ewma_weight``, then a
constant weight ``ewma_weight`` per observation (~1/weight observations of memory).

Priors (until measured): ``verify_s(p) = prior_verify_s · (1 + prior_verify_slope · (p - 1))``
with 50 ms and 5 %/position, ``draft_s_per_token = 5 ms`` (Leviathan's c = 0.1) and no round
trip: the memory-bound picture of the paper, so a fresh deployment speculates moderately and
replaces the priors after its first requests. Only ratios matter to the controller.

Not thread-safe: one owner calls it.
"""

from __future__ import annotations

from specdec.request import MAX_SPECULATION_LENGTH


class Ewma:
    """Exponentially weighted mean with a running-mean warm-up (see module docstring)."""

    def __init__(self, weight: float = 0.2):
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"EWMA weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.n = 0
        self.value: float | None = None

    def update(self, x: float) -> float:
        self.n += 1
        w = max(self.weight, 1.0 / self.n)
        self.value = x if self.value is None else self.value + w * (x - self.value)
        return self.value


def _check_seconds(seconds: float) -> float:
    seconds = float(seconds)
    if not seconds >= 0.0 or seconds == float("inf"):
        raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
    return seconds


def _interpolate(pts: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of the sorted measured ``(x, seconds)`` points at ``x`` between its
    nearest measured neighbours; None when ``x`` is not between two of them."""
    lo = [pt for pt in pts if pt[0] < x]
    hi = [pt for pt in pts if pt[0] > x]
    if not (lo and hi):
        return None
    (x1, t1), (x2, t2) = lo[-1], hi[0]
    return t1 + (t2 - t1) * (x - x1) / (x2 - x1)


def _fit_slope(pts: list[tuple[float, float]]) -> float:
    """Least-squares slope (seconds per unit of x) through at least two measured ``(x, seconds)``
    points with distinct x, never below 0 (for extrapolating beyond them)."""
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    return max(sum((x - mx) * (t - mt) for x, t in pts) / sum((x - mx) ** 2 for x, _ in pts), 0.0)


class CostModel:
    """Measured per-step costs of one (proposer, target) pairing. All times in seconds.

    Args:
        prior_verify_s: prior verify time of one position.
        prior_verify_slope: prior relative extra verify cost per additional position.
        prior_draft_s_per_token: prior draft time per drafted token.
        prior_round_trip_s: prior draft↔target round trip per K > 0 step.
        ewma_weight: weight of a new observation once warmed up.
        prior_draft_first_ratio: with blocks measured at a single length, the first draft
            forward of a block costs this many later ones (module docstring).
        max_positions: largest number of positions scored (K + 1).
        extrapolation: outside the measured sizes, ``"trend"`` (the least-squares slope of the
            measured points, flat where it is <= 0) or ``"monotone"`` (through the origin
            below, from the dearest measured size above). Module docstring.

    Raises:
        ValueError: a prior out of range or an unknown ``extrapolation``.

    ``CostModel(prior_verify_s=1, prior_verify_slope=0, prior_draft_s_per_token=c)`` with no
    observations is Leviathan et al.'s constant-cost model: step_time(k) = 1 + c·k.
    """

    def __init__(
        self,
        *,
        prior_verify_s: float = 0.05,
        prior_verify_slope: float = 0.05,
        prior_draft_s_per_token: float = 0.005,
        prior_round_trip_s: float = 0.0,
        ewma_weight: float = 0.2,
        max_positions: int = MAX_SPECULATION_LENGTH + 1,
        extrapolation: str = "trend",
        prior_draft_first_ratio: float = 1.5,
    ):
        if extrapolation not in ("trend", "monotone"):
            raise ValueError(f"extrapolation must be 'trend' or 'monotone', got {extrapolation!r}")
        self.extrapolation = extrapolation
        if not prior_verify_s > 0:
            raise ValueError(f"prior_verify_s must be > 0, got {prior_verify_s}")
        if prior_verify_slope < 0 or prior_draft_s_per_token < 0 or prior_round_trip_s < 0:
            raise ValueError("prior slopes and times must be >= 0")
        self.prior_verify_s = float(prior_verify_s)
        self.prior_verify_slope = float(prior_verify_slope)
        self.prior_draft_s_per_token = float(prior_draft_s_per_token)
        self.prior_round_trip_s = float(prior_round_trip_s)
        if not prior_draft_first_ratio >= 1.0:
            raise ValueError(f"prior_draft_first_ratio must be >= 1, got {prior_draft_first_ratio}")
        self.prior_draft_first_ratio = float(prior_draft_first_ratio)
        self.ewma_weight = ewma_weight
        self.max_positions = max_positions
        self._draft = Ewma(ewma_weight)
        self._rtt = Ewma(ewma_weight)
        self._verify: dict[int, Ewma] = {}
        self._points: list[tuple[int, float]] | None = None  # :meth:`verify_points`, until they change
        self._draft_blocks: dict[int, Ewma] = {}  # drafted tokens d -> seconds of one block of d
        self._prefill = Ewma(ewma_weight)

    # ---------------------------------------------------------------- observations

    def observe_draft(self, k: int, seconds: float) -> None:
        """Drafting ``k`` tokens took ``seconds`` (k = 0 is ignored)."""
        seconds = _check_seconds(seconds)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if k > 0:
            self._draft.update(seconds / k)

    def observe_verify(self, positions: int, seconds: float) -> None:
        """Scoring and verifying ``positions`` (= K + 1) positions in one target pass took ``seconds``."""
        seconds = _check_seconds(seconds)
        if not 1 <= positions <= self.max_positions:
            raise ValueError(f"positions must be in 1..{self.max_positions}, got {positions}")
        self._verify.setdefault(positions, Ewma(self.ewma_weight)).update(seconds)
        self._points = None

    def observe_draft_block(self, drafted: int, seconds: float) -> None:
        """One draft block of ``drafted`` tokens (``drafted`` forwards) took ``seconds``."""
        seconds = _check_seconds(seconds)
        if not 1 <= drafted < self.max_positions:
            raise ValueError(f"drafted must be in 1..{self.max_positions - 1}, got {drafted}")
        self._draft_blocks.setdefault(drafted, Ewma(self.ewma_weight)).update(seconds)

    def observe_draft_prefill(self, seconds: float) -> None:
        """The draft's prompt prefill of one speculating request took ``seconds``."""
        self._prefill.update(_check_seconds(seconds))

    def observe_round_trip(self, seconds: float) -> None:
        """One draft↔target round trip (transport only) took ``seconds``."""
        self._rtt.update(_check_seconds(seconds))

    # ---------------------------------------------------------------- estimates

    @property
    def draft_s_per_token(self) -> float:
        return self.prior_draft_s_per_token if self._draft.value is None else self._draft.value

    @property
    def round_trip_s(self) -> float:
        return self.prior_round_trip_s if self._rtt.value is None else self._rtt.value

    @property
    def draft_prefill_s(self) -> float:
        """Seconds of the draft's prompt prefill per speculating request (0 until measured)."""
        return 0.0 if self._prefill.value is None else self._prefill.value

    def draft_block_s(self, drafted: int) -> float:
        """Seconds of one draft block of ``drafted`` tokens, ``first + (drafted - 1) · later``
        (module docstring); 0 for ``drafted = 0``."""
        if drafted < 0:
            raise ValueError(f"drafted must be >= 0, got {drafted}")
        if drafted == 0:
            return 0.0
        pts = sorted((d, e.value) for d, e in self._draft_blocks.items() if e.value is not None)
        if not pts:
            return drafted * self.draft_s_per_token
        for d, t in pts:
            if d == drafted:
                return t
        if len(pts) == 1:
            d0, t0 = pts[0]
            later = t0 / (self.prior_draft_first_ratio + d0 - 1)
            return later * (self.prior_draft_first_ratio + drafted - 1)
        between = _interpolate(pts, drafted)
        if between is not None:
            return between
        later = _fit_slope(pts)
        if drafted < pts[0][0]:  # below the shortest measured block: never below one later forward per token
            d_lo, t_lo = pts[0]
            return max(t_lo - later * (d_lo - drafted), t_lo * drafted / d_lo)
        d_hi, t_hi = pts[-1]
        return t_hi + later * (drafted - d_hi)

    def verify_points(self) -> list[tuple[int, float]]:
        """The measured verify points ``(positions, seconds)``, sorted by positions: one list kept
        until an observation (or :meth:`points_changed`) changes them, so pricing many shapes does
        not sort every point for each (a batched server's curve holds a point per positions count
        it ran: hundreds with a positions budget of 512). Do not modify it."""
        if self._points is None:
            self._points = sorted((p, e.value) for p, e in self._verify.items() if e.value is not None)
        return self._points

    def points_changed(self) -> None:
        """Forget :meth:`verify_points`: for an owner that edits a point's :class:`Ewma` in place
        (:class:`specdec.control.batch_cost.BatchCostModel`)."""
        self._points = None

    def _prior_verify(self, p: float) -> float:
        return self.prior_verify_s * (1.0 + self.prior_verify_slope * (p - 1))

    def verify_s(self, positions: int) -> float:
        """Estimated verify time for ``positions`` positions (measured, interpolated or prior)."""
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        pts = self.verify_points()
        if not pts:
            return self._prior_verify(positions)
        e = self._verify.get(positions)
        if e is not None and e.value is not None:
            return e.value
        if self.extrapolation == "monotone" and positions < pts[0][0]:
            p_lo, t_lo = pts[0]
            return t_lo * positions / p_lo
        if len(pts) == 1:
            p0, t0 = pts[0]
            return t0 * self._prior_verify(positions) / self._prior_verify(p0)
        between = _interpolate(pts, positions)
        if between is not None:
            return between
        slope = _fit_slope(pts)
        if positions < pts[0][0]:  # below the smallest measured size
            p_lo, t_lo = pts[0]
            slope = min(slope, t_lo / p_lo)
            return t_lo - slope * (p_lo - positions)
        p_hi, t_hi = pts[-1]
        if self.extrapolation == "monotone":
            t_hi = max(t for _, t in pts)
        return t_hi + slope * (positions - p_hi)

    def step_terms(self, k: int) -> dict[str, float]:
        """The terms of ``step_time(k)``: draft_s, verify_s, round_trip_s, total_s."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        draft = self.draft_block_s(k)
        verify = self.verify_s(k + 1)
        rtt = self.round_trip_s if k > 0 else 0.0
        return {"draft_s": draft, "verify_s": verify, "round_trip_s": rtt, "total_s": draft + verify + rtt}

    def step_time(self, k: int) -> float:
        """Seconds of one step with K = k (k = 0: one verify of 1 position, nothing else)."""
        return self.step_terms(k)["total_s"]

    def request_speedup(self, expected_tokens: float, step_s: float, tokens: int | None) -> float:
        """Predicted speedup over plain decoding of a request of ``tokens`` new tokens whose
        speculation steps emit ``expected_tokens`` in ``step_s`` seconds each, the draft's
        prompt prefill (:attr:`draft_prefill_s`) included:

            (tokens / E[N] · step_s + draft_prefill_s)  vs  tokens · step_time(0)

        ``tokens`` None (unknown length): the steady state, ``E[N] · step_time(0) / step_s``.
        """
        t0 = self.step_time(0)
        if tokens is None or tokens <= 0 or self.draft_prefill_s <= 0:
            return expected_tokens * t0 / step_s
        return tokens * t0 / (tokens / expected_tokens * step_s + self.draft_prefill_s)

    def export_observations(self) -> dict:
        """What was measured, as plain data (JSON-safe): per term ``[observations, value]``
        (``"verify"`` keyed by positions as a string). Priors and weights are not included:
        they belong to the constructor."""
        return {
            "draft": [self._draft.n, self._draft.value],
            "round_trip": [self._rtt.n, self._rtt.value],
            "verify": {str(p): [e.n, e.value] for p, e in sorted(self._verify.items())},
            "draft_blocks": {str(d): [e.n, e.value] for d, e in sorted(self._draft_blocks.items())},
            "draft_prefill": [self._prefill.n, self._prefill.value],
        }

    def import_observations(self, data: dict) -> None:
        """Replace the measurements with :meth:`export_observations`'s ``data``; all or nothing.

        Raises:
            ValueError, TypeError, KeyError: ``data`` is not of that shape (or positions out of
                1..max_positions, times negative or not finite).
        """

        def ewma(pair) -> Ewma:
            n, value = pair
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"observation count must be an integer >= 0, got {n!r}")
            e = Ewma(self.ewma_weight)
            e.n = n
            e.value = None if value is None else _check_seconds(value)
            return e

        draft, rtt = ewma(data["draft"]), ewma(data["round_trip"])
        verify = {}
        for p, pair in dict(data["verify"]).items():
            p = int(p)
            if not 1 <= p <= self.max_positions:
                raise ValueError(f"positions must be in 1..{self.max_positions}, got {p}")
            verify[p] = ewma(pair)
        blocks = {}
        for d, pair in dict(data.get("draft_blocks") or {}).items():  # absent: written before they existed
            d = int(d)
            if not 1 <= d < self.max_positions:
                raise ValueError(f"drafted must be in 1..{self.max_positions - 1}, got {d}")
            blocks[d] = ewma(pair)
        prefill = ewma(data.get("draft_prefill") or [0, None])
        self._draft, self._rtt, self._verify = draft, rtt, verify
        self._points = None
        self._draft_blocks, self._prefill = blocks, prefill

    def snapshot(self) -> dict:
        """Plain-data view: current terms and what has been measured (observation counts)."""
        return {
            "draft_s_per_token": self.draft_s_per_token,
            "draft_observations": self._draft.n,
            "round_trip_s": self.round_trip_s,
            "round_trip_observations": self._rtt.n,
            "verify_s": {p: e.value for p, e in sorted(self._verify.items())},
            "verify_observations": {p: e.n for p, e in sorted(self._verify.items())},
            "draft_block_s": {d: e.value for d, e in sorted(self._draft_blocks.items())},
            "draft_block_observations": {d: e.n for d, e in sorted(self._draft_blocks.items())},
            "draft_prefill_s": self.draft_prefill_s,
            "draft_prefill_observations": self._prefill.n,
        }
