"""Measured seconds of batched target and draft forwards (K under load's cost model).

Part of :mod:`specdec.control.batch_k`: :class:`BatchCostModel` gives the step time
``T(K) = Σ_j D(rows drafting at j) + V(rows, positions)`` that
:func:`specdec.control.batch_choice.choose_batch_ks` maximises tokens per second over.
"""

from __future__ import annotations

import collections
import statistics
from typing import Sequence

from specdec.control.cost_model import CostModel

#: Forwards of one shape whose median is what a new measurement of that shape feeds the curves
#: (:class:`BatchCostModel`, "Outliers").
RECENT_FORWARDS = 9

#: Verify forwards (of any shape) after which a shape's or a positions count's samples are stale:
#: priced at most at a fresh count of more positions (:class:`BatchCostModel`, "Stale points").
#: One window: the s21 trace's 8-position samples were 10-12 forwards old when the controller left
#: K = 0 on them, so two or three windows would not have caught it; shorter, a count that really
#: is dearer than a larger one (4 against 5 positions, served) would be re-run more often.
STALE_FORWARDS = RECENT_FORWARDS
_MISSING = object()

#: Decode forwards per shape (rows, positions) whose (context, seconds) the context rates are fitted
#: over (:class:`BatchCostModel`, "Context").
CONTEXT_SAMPLES = 48
#: Least spread (pooled standard deviation within shapes, tokens) of the rows' mean context over
#: the fitted forwards before the context rates are used: over a narrower range noise, not the
#: context, decides the fit (:class:`BatchCostModel`, "Context").
CONTEXT_MIN_SD = 12.0
#: Fewest forwards in the fit (shapes of at least 4 forwards each).
CONTEXT_MIN_FORWARDS = 16
#: Decode forwards with a context between two fits of the rates.
CONTEXT_REFIT = 8
#: Shapes whose forwards the rates are fitted over: the most recently observed (a fit's work bounded).
CONTEXT_SHAPES = 32
#: The two rates are fitted apart only where the shapes' positions per row differ enough: the
#: fit's normal matrix has ``det > CONTEXT_SEPARABLE · s11 · s22`` (the two regressors' squared
#: correlation below 1 - this); else one rate over ``rows + CONTEXT_QUERY_SHARE · positions``.
CONTEXT_SEPARABLE = 0.05
#: Per cached token, a query position's cost relative to a row's, where the rates are not
#: separable: the 2-core Zen 4 measured ~8e-6 s per row and ~4e-6 s per query position
#: (docs/bench/batching/context-s26/: 8 x 1 positions 1.2e-5 s per row and token, 8 x 5 2.7e-5).
CONTEXT_QUERY_SHARE = 0.5


class BatchCostModel:
    """Measured seconds of batched forwards, as functions of what the batch holds.

    - ``verify_s(rows, positions)``: one batched target forward of ``positions`` positions over
      ``rows`` sessions = a per-positions curve + ``row_s`` per row beyond those its points were
      measured at ("Rows a point was measured at"; cache
      gathering, per-row decisions; an EWMA of the residuals against the curve). The curve is
      an EWMA of the measured seconds per positions count, linear between measured counts,
      above the largest on the least-squares slope of the measured points (never decreasing),
      and **below the smallest on the line through the origin**: ``t_lo · positions / p_lo``;
      above the largest, from the dearest measured forward on the least-squares slope of the
      measured points, clamped at >= 0 (``extrapolation="monotone"`` of
      :class:`specdec.control.cost_model.CostModel`).
    - ``draft_s(rows)``: one batched draft forward (one draft position) of ``rows`` sessions:
      measured, interpolated between measured row counts, and **above the most rows measured**
      ``R`` at least ``min(draft_s(R) + (rows - R) · c, draft_s(R) · rows / R)``, ``c`` the
      measured catch-up seconds per token (:meth:`catchup_s`: the draft's own marginal cost of one
      more position in a forward) once catch-ups were measured; the second term, ``rows / R``
      forwards of ``R`` rows, bounds what batching can cost (class docstring, "Draft rows above
      the measured").
    - ``catchup_s(tokens)``: feeding ``tokens`` positions the draft has not seen (a session's
      prompt, or every token it decoded at K = 0: the draft does not run at K = 0 and catches
      up lazily on its next drafting step). A catch-up is a prefill, and prefill-sized forwards
      are measured on the target's verify curve, not on the draft's (a one-position row per
      session: on the CPU its cost is mostly per-forward overhead, flat in rows, so it would
      price 300 positions like 8). So ``catchup_s(n) = n · c · r``: ``c`` the fewest seconds per
      position of any verify forward measured at >= 16 positions (prefill chunks, wide decode
      batches: the per-forward overhead spread thin; the least, not a fit, because one cold or
      contended forward, e.g. a first prefill of 57 positions in 10.7 s where the next took
      0.8 s, bent a fitted curve into pricing a 100-token catch-up at 13 s and held one client
      whose speculation paid 1.8x at K = 0), and ``r = draft_s(R) / verify_s(R, R)`` at the most
      rows ``R`` a draft forward was measured at (the draft's cost relative to the target's at
      equal size; the priors' ratio before any). Before any such forward: the verify curve at
      ``n`` positions times ``r``. Once catch-ups were measured, what they measured instead
      (:meth:`observe_catchup`: a session's drafting seconds in its first drafting step after
      K = 0, beyond its K draft forwards, per token it was behind; an EWMA). Instead, not at
      least: an overpriced catch-up holds its tenant at K = 0, where no catch-up is measured
      that could lower the price (the main job simulated with a 30 s first prefill, its only
      forward of >= 16 positions: the model priced a catch-up at 18x what the measured ones
      cost, and after the goodput guard's 12 steps at K = 0 the client stayed there;
      tests/test_batch_one_client.py), while an underpriced one is run and measured. Served, the
      sessions of a tenant leaving K = 0 catch up in the same batched draft forwards while
      the target's batch waits for them, so a catch-up cost each 2-6 s where the cheapest
      verify forward priced it at 0.9 s (w8a8 pair, 8 clients).
      Left out, the controller took a tenant held at K = 0 back to K > 0 (or probed it) for a
      predicted gain of 1-2 %, and every session of it then fed tens of tokens to the draft in
      its first drafting step (1-4 s of drafting on the w8a8 demo pair, 8 clients,
      docs/bench/batching/w8a8/).

    Why the origin below. The first forwards a replica measures are its prompts' prefill
    chunks (tens to hundreds of positions); every decode forward (rows · (K + 1) positions) lies
    below them. Extrapolated on the measured slope, which between two noisy prefill forwards
    is often <= 0 and then clamped flat (the per-request model's ``below="trend"``), a decode
    forward of 8 positions (K = 0) and one of 40 (K = 4) were both predicted at the prefill's
    5.5 s: speculation looked free, the controller chose K = 4, and running at K = 4 it never
    measured a forward small enough to learn otherwise (served, int4 target, 2-core CPU,
    docs/bench/batching/int4/served-tenants-guard.md); and above the largest, 72 positions (K = 8)
    at the 64-position forward's 3.1 s, cheaper than the 57-position one. Proportional extrapolation is exact
    where a forward's cost is linear in its positions (compute-bound: the CPU), and elsewhere
    (memory-bound: a GPU's small forwards cost about the same) it errs towards the smaller
    forward: the controller then runs it and measures a decode-sized forward, after which the
    curve is interpolated between measured points. The flat error never corrects itself, this
    one does after one decision.

    Prefill forwards are not decode forwards (``observe_verify(..., prefill=True)``): a forward
    that holds a prompt's prefill is kept off the verify curve (it prices catch-ups only). One
    session's first forward (its 42-position prompt with its first block) is no point of the
    curve its decode steps lie on: int4 prefills dear (2-10 s for 42 positions where decode
    forwards of 1 to 4 positions took 0.19-0.29 s on the loaded 2-core CPU, the first one in a
    fresh process the dearest), and interpolated between it and the 1-position forward of K = 0,
    a 2-position verify was priced at 0.19 + (X - 0.19) / 41 s: from X ≈ 5 s on no K > 0 paid
    even at α = 0.9, so no probe ran, the K = 0 steps measured only the 1-position forward,
    and the main job (one client, code, acceptance 0.95) ran its 128 tokens at K = 0
    (1.03 tokens/step where it speculates at 2-2.7). Off the curve, the decode forwards
    measured decide, the prior's slope between them before they do.

    **Draft rows above the measured.** A warmed replica has often measured the draft only at the
    rows of one client (one row at K = 4) and of probes; priced above them on the draft curve's
    trend (with one measured count: the prior's 5 % per row), 8 rows cost 1.35 one-row forwards.
    The int4 draft's batched forward grows about linearly in its rows on the CPU (session 11's
    2-core EPYC, 8 clients at K = 1: 8.98 s of drafting over ~67 steps, ~0.13 s per 8-row forward
    against ~0.04 s at one row), so K = 1 for all 8 sessions looked to pay, and the warmed
    controller ran K = 1 on 32 of 239 steps at 8 clients x 32 tokens, 0.86x K = 0 paired
    (docs/bench/batching/inprocess-s11-lead/log.txt). The
    draft's catch-ups (prompts, tokens decoded at K = 0) are its own forwards of many positions:
    their seconds per position beyond a draft forward's are what one more row adds on a CPU
    (compute grows with positions), so above the most rows measured a draft forward is priced
    at least at the largest measured one plus that rate per extra row, but never above the
    largest measured forward repeated ``rows / R`` times (a served catch-up rate holds waiting on
    other sessions too: 2-6 s where 0.9 s was priced, "catchup_s" above). An overprice here is
    corrected when the rows run (probes run one tenant's rows, below the full batch's), an
    underprice costs whole steps of every session.

    **Outliers.** Each verify and draft forward measured feeds the curves' EWMAs the median
    of the last :data:`RECENT_FORWARDS` forwards of its shape (rows and positions; rows for a
    draft forward), not its own seconds: one forward preempted by another process (0.3-0.45 s
    where the draft's one-row forward takes 0.035-0.045 s) moved the EWMA from 0.037 to 0.085
    and, after a second, to 0.163 s, and the controller then held one client on code
    (acceptance 0.97) at K = 0, where no draft forward runs and the price is never corrected:
    128 steps at K = 0, 9.2 tokens/s against 12.0 at K = 4 unbatched (served, w8a8 pair, load
    11; the unbatched path never measures its forwards and stays on the priors). A lasting
    change (sustained load) moves the median after about half the window.

    **Stale points.** A shape's recent forwards and a count's curve point keep what it cost when
    it last ran, however long ago: the controller re-measures only the shapes it runs. In process
    at 8 clients (w8a8 pair, 2-core Zen 4 beside a test run, docs/bench/batching/inprocess-s21-trace/),
    the K = 0 forward (8 rows, 8 positions) kept the 0.39 s median of its six cold warm-up
    forwards while 10 and 12 positions, measured in the arm's first ticks, cost 0.14-0.18 s: K = 0
    looked dearer than K = 1, and the controller left it (the old median would have held until
    five new 8-position forwards ran). So a shape priced from samples last observed more than
    :data:`STALE_FORWARDS` verify forwards ago (of any shape, prefills included) costs at most the
    cheapest count of more positions at the same rows priced from samples observed since (a verify
    of fewer positions does not cost more than one of more under current conditions), and the
    first forward of it run so priced replaces its samples (its window and its curve point,
    which is then thin, :meth:`verify_s`), as a served forward replaces the calibration's ("Calibration
    is a prior of the shapes"): fed to the old window it would leave the price where it was.
    Fresh against fresh stays as measured: served (w8a8 pair, tests/test_batch_cost_outliers.py)
    4 positions cost 0.138 s and 5 cost 0.123, and a floor over all counts (each at least the
    dearest count below it) priced K = 4 above K = 2 there and held the client at K = 2. A count
    that really is dearer is re-run, priced below what it costs, once in about
    :data:`STALE_FORWARDS` forwards, and its measured price then holds again: the error corrects
    itself, where a stale overprice of a shape the controller stopped running never did.

    **Context.** A forward's seconds also grow with the tokens already in its rows' KV caches:
    each row's cache is read per layer, and each query position attends to its row's cached
    tokens (on the CPU one attention call per query row,
    :func:`specdec.engine.invariant.rowwise_attention`). In process on the 2-core Zen 4 (w8a8
    pair, ``docs/bench/batching/context-s26/``), 8 rows x 1 position cost 0.116 s over 43-token
    contexts and 0.162 s over 491 (1.2e-5 s per row and cached token), 8 rows x 5 positions 0.291
    and 0.391 s (2.7e-5): about 8e-6 s per row and 4e-6 per query position, per cached token. A
    shape's price is the median of its recent forwards, so after a 128-token group of 8 clients
    the K = 0 forward was priced at its long contexts' 0.151 s where the next group, at short
    contexts, ran it in 0.12: K = 0 at 53.0 tokens/s against 59.2 for K = 4 priced from forwards
    measured at shorter contexts, the controller ran K = 3-4 for two ticks and paid both tenants'
    draft catch-up (1.19 s; that round 0.89x K = 0, ``docs/bench/batching/inprocess-s25-quiet/``).
    So a forward observed with its rows' mean context ``c`` (``observe_verify(..., context=c)``)
    is kept on the curves and in its shape's window as its seconds at context 0, ``seconds -
    (row_s · rows + query_s · positions) · c``, and priced at the batch's context
    (:meth:`set_context`: the running sessions' mean cached tokens; before it, the last
    forward's) by adding the same term. ``row_s`` and ``query_s`` (>= 0) are the least-squares
    rates of seconds against ``rows · c`` and ``positions · c`` pooled within shapes (each
    shape's forwards centred on their own means, so no shape's level enters them), over the last
    :data:`CONTEXT_SAMPLES` decode forwards of each of the :data:`CONTEXT_SHAPES` shapes observed
    last, refitted every :data:`CONTEXT_REFIT` and once more without the forwards more than 3
    robust standard deviations off the first fit (a preempted forward). The two are told apart
    only by shapes of different positions per row (:data:`CONTEXT_SEPARABLE`); before such shapes
    spread in context, one rate over ``rows + CONTEXT_QUERY_SHARE · positions``. Both are 0
    (context-blind prices) until the fitted forwards' contexts first spread over at least
    :data:`CONTEXT_MIN_SD` tokens (pooled standard deviation within shapes); a later refit over
    forwards that spread less keeps the rates it has. A refit
    re-expresses the shapes' windows from their raw seconds and shifts each curve point by the
    change of rates times the mean units of its samples. Device-agnostic: the rates are measured,
    so where context costs little (a GPU's forward bound by reading the weights) they are small
    and the prices nearly context-blind. Forwards without a context (the start-up calibration, a
    target that does not report one) are taken as at the pricing context.

    **Rows a point was measured at.** A positions count's curve point is fed by forwards of some
    rows (tracked, with the point's own EWMA weights), so a shape priced on the curve adds the row
    term only for the rows beyond those: ``row_s · (rows - rows of the point)`` (before: ``rows -
    1``), and a forward teaches the row term only where it has at least one row more than its
    count's point. A price taken from other points (interpolated, extrapolated, a cap from the
    well-measured line, a served or calibrated count) is based on those points' rows; a count's
    rows restart with its window when it is measured :attr:`THIN_SAMPLES` times (its point then is
    that shape's median). Before (the session-26 quiet goal run, ``docs/bench/batching/inprocess-s26-quiet/``):
    the 8 x 1 K = 0 forward, stale after a one-client group, was re-measured once (its window and
    point replaced: "Stale points"), priced on its 1-sample point (0.143 s, measured at 8 rows)
    plus ``row_s`` for 7 more rows: 0.193 s, ``row_s`` itself grown to 0.0096 s from 8-row forwards
    compared with points measured at 8 rows; K = 1 for one tenant looked 1.1x K = 0 and ran for 30
    ticks (that round 0.82x K = 0)).

    **Calibration is a prior of the shapes.** A replica's start-up calibration measures one
    session's verify forwards at every K (:meth:`observe_verify` ``calibration``) so that its first
    request is not priced on the priors. Its few forwards run while the process, and often the
    replica started beside it, are still warming: served on the 2-core EPYC (w7a8 pair, session
    19, ``clients-s19-guard``), it priced 3 and 5 positions at 0.184 and 0.195 s beside one at
    0.139 s, where 3-5 positions cost ~0.13 s in service, so K = 4 at acceptance 0.9 looked worse
    than K = 0 (7.1 against 7.8 tokens/s) and the lone client ran K = 0 on every step (0.80x the
    unbatched path speculating on the same forwards). A tenant held at K = 0 never runs the
    shapes that would correct it. So: (1) the first forward of a count measured in service
    replaces the calibration's samples of that count (window and curve; the first one-row
    forward: a forward of more rows prices its row term against the point); (2) a count the
    calibration measured and service never did costs at most what the fewest positions above it
    measured in service cost (the curve never decreases: a calibrated 5 at 0.195 s is not dearer
    than a served 9 at 0.15 s); (3) :meth:`optimistic` prices a count never measured in service
    at most at its price on the curve of the forwards measured in service alone (interpolated
    and extrapolated as the full curve is, the calibration's samples left out): a probe
    (:meth:`BatchKController.probe_k`) is chosen at those prices when the measured ones give it
    K = 0, so it runs the unmeasured shapes once and the decisions after it use what they cost
    in service. With one count served, that curve extrapolates on the prior's slope (5 % of the
    one-position price per position), flatter than a CPU's verify: a probe may then run a K
    that its measured forwards stop at once. (Not the least a count can cost, a flat curve: on the CPU a verify grows about
    linearly in its positions, and an int4-like model so priced probed 8 sessions at K = 8,
    72 positions at 8x the cost of 8: tests/test_batch_goodput.py.)

    **Pricing many shapes.** A verify price reads the curve's points (sorted), the well-measured
    counts and their line, the rows behind the points and the counts still fresh: each O(points),
    and a batched server's curve holds a point per positions count it ran (hundreds with a
    positions budget of 512). One decision prices tens of shapes (its search's candidates, the
    probes' what-ifs), so these are kept (:attr:`_derived`, :meth:`CostModel.verify_points`) until
    an observation, a new pricing context or a context refit changes what they are made of, and
    every price is bit for bit the one computed afresh (tests/test_batch_cost_memo.py). Served, a
    tick's controller work with budget 512 (a curve of ~500 points, guards included, 2-core Zen 4): 2
    tenants x 16 sessions 1.65 -> 0.57 ms, 32 tenants 5.4 -> 3.5 ms (docs/bench/batching/host-s28/).

    Args:
        max_positions: largest positions count recorded (the positions budget, or more).
        prior_verify_s, prior_draft_s: priors of a 1-position verify and a 1-row draft forward
            (seconds).
        verify_extrapolation: of the verify curve outside its measured positions counts,
            ``"monotone"`` (above) or ``"trend"`` (the model before it, kept for comparison in
            tests).
    """

    def __init__(self, *, max_positions: int = 4096, prior_verify_s: float = 0.05, prior_draft_s: float = 0.01,
                 verify_extrapolation: str = "monotone"):
        self.verify = CostModel(prior_verify_s=prior_verify_s, prior_verify_slope=0.05, max_positions=max_positions,
                                extrapolation=verify_extrapolation)
        #: the verify curve of forwards measured in service alone (no calibration): the
        #: optimistic prices (:meth:`verify_s` ``optimistic``)
        self._served_curve = CostModel(prior_verify_s=prior_verify_s, prior_verify_slope=0.05,
                                       max_positions=max_positions, extrapolation=verify_extrapolation)
        self.draft = CostModel(prior_verify_s=prior_draft_s, prior_verify_slope=0.05, max_positions=max_positions)
        self._row_s = 0.0
        self._row_n = 0
        self._prior_ratio = prior_draft_s / prior_verify_s
        self._catchup_rate: float | None = None  # measured seconds per caught-up token (EWMA)
        #: the fewest positions per row of any verify forward measured (inf before any): a
        #: decode forward has K + 1, a prompt's prefill chunk tens
        self.min_positions_per_row = float("inf")
        #: the fewest seconds per position of any verify forward of >= 16 positions (inf before any)
        self._cheapest_per_position = float("inf")
        self._prefill_n = 0  # prefill forwards seen (kept off the verify curve)
        #: positions -> decode forwards of that count measured in service (not start-up
        #: calibration; class docstring, "Calibration is a prior of the shapes")
        self._served: dict[int, int] = {}
        #: positions counts the start-up calibration measured
        self._calibrated: set[int] = set()
        self._superseded: set[int] = set()  # calibrated counts whose calibration samples were dropped
        #: counts once a positions count is first measured in service or by the calibration
        self.shapes_version = 0
        #: ("verify", rows, positions) or ("draft", rows) -> seconds of its recent forwards
        self._recent: dict[tuple, collections.deque] = {}
        #: observations made so far (:meth:`observe_verify`, :meth:`observe_draft`,
        #: :meth:`observe_catchup`): a price computed at one version holds until the next
        self.version = 0
        self._prices: tuple[int, dict[bool, dict]] = (-1, {})  # (version, optimistic -> memo) of :meth:`prices`
        #: verify forwards observed so far (prefill and calibration ones too): the clock of "Stale points"
        self._forwards = 0
        #: ("verify", rows, positions) (a shape's window) or ("point", positions) (the curve's point)
        #: -> :attr:`_forwards` at its last observation
        self._seen: dict[tuple, int] = {}
        #: seconds a cached token adds per row of a forward, and per query position of it (its
        #: attention's query-key pairs; class docstring, "Context")
        self.context_row_s = 0.0
        self.context_query_s = 0.0
        #: (rows, positions) -> (mean context, seconds) of its last decode forwards with a context,
        #: for the :data:`CONTEXT_SHAPES` shapes observed last
        self._context_samples: collections.OrderedDict[tuple[int, int], collections.deque] = collections.OrderedDict()
        self._context_new = 0  # forwards with a context since the last fit
        #: the rows' mean context prices are read at (:meth:`set_context`; before it the last
        #: forward's; None: none known)
        self.context: float | None = None
        self._context_set = False
        #: ("verify", rows, positions) -> (seconds, rows · context, positions · context) of the
        #: forwards in its window
        self._recent_raw: dict[tuple, collections.deque] = {}
        #: positions -> EWMA of (rows · context, positions · context) of what fed its curve point
        #: (and the served curve's point)
        self._point_units: dict[int, tuple[float, float]] = {}
        self._served_units: dict[int, tuple[float, float]] = {}
        #: positions -> EWMA of the rows of the forwards that fed its curve point, and the served
        #: curve's (class docstring, "Rows a point was measured at")
        self._point_rows: dict[int, float] = {}
        self._served_rows: dict[int, float] = {}
        #: what pricing derives from the state above (well-measured counts, the rows behind a curve's
        #: price, stale caps, prices at the context, the draft's points), kept until an observation, a
        #: context or a context refit changes that state (:meth:`_changed`; class docstring,
        #: "Pricing many shapes")
        self._derived: dict = {}

    def set_context(self, context: float | None) -> None:
        """Price forwards at rows holding ``context`` cached tokens on average (class docstring,
        "Context"); None leaves the context as it is.

        Raises:
            ValueError: ``context`` negative or not finite.
        """
        if context is None:
            return
        if not 0 <= context < float("inf"):
            raise ValueError(f"context must be finite and >= 0, got {context}")
        self._context_set = True
        if context != self.context:
            self.context = float(context)
            self._changed(points=False)
            if self.context_row_s or self.context_query_s:
                self.version += 1

    def _changed(self, points: bool = True) -> None:
        """Forget what pricing derived from the model's state (:attr:`_derived`; with ``points`` the
        curves' sorted points too): called by every method that changes that state, before and after
        it does."""
        self._derived = {}
        if points:
            self.verify.points_changed()
            self._served_curve.points_changed()

    def _memo(self, key, make):
        """``make()``, kept in :attr:`_derived` under ``key`` until :meth:`_changed` (kept in the
        dict it was looked up in: a change while ``make`` runs leaves the new dict without it).
        The curves (:attr:`verify`, :attr:`draft`) are fed only through this model's
        ``observe_*`` methods, which call :meth:`_changed`."""
        derived = self._derived
        got = derived.get(key, _MISSING)
        if got is _MISSING:
            got = derived[key] = make()
        return got

    def _units(self, rows: int, positions: int, context: float | None) -> tuple[float, float]:
        """(rows · context, positions · context) of a forward (the pricing context when None; 0
        before any)."""
        c = (self.context if context is None else context) or 0.0
        return rows * c, positions * c

    def _context_s(self, units: tuple[float, float]) -> float:
        """Seconds the context of a forward of these units adds (class docstring, "Context")."""
        return self.context_row_s * units[0] + self.context_query_s * units[1]

    def _context_term(self, rows: int, positions: int) -> float:
        """What the pricing context adds to a forward of ``rows`` rows and ``positions`` positions (s)."""
        return self._context_s(self._units(rows, positions, None))

    def _drop_window(self, shape: tuple) -> None:
        self._recent.pop(shape, None)
        self._recent_raw.pop(shape, None)

    def _drop_point(self, positions: int) -> None:
        self.verify._verify.pop(positions, None)
        self.verify.points_changed()
        self._point_units.pop(positions, None)
        self._point_rows.pop(positions, None)

    def _observe_context(self, rows: int, positions: int, context: float, seconds: float) -> None:
        """Keep a decode forward's (context, seconds); refit every :data:`CONTEXT_REFIT` of them."""
        shape = (rows, positions)
        self._context_samples.setdefault(shape, collections.deque(maxlen=CONTEXT_SAMPLES)).append(
            (float(context), float(seconds)))
        self._context_samples.move_to_end(shape)
        if len(self._context_samples) > CONTEXT_SHAPES:
            self._context_samples.popitem(last=False)
        self._context_new += 1
        if self._context_new >= CONTEXT_REFIT:
            self._context_new = 0
            rates = self.fit_context()
            if rates is not None:
                self._set_context_rates(*rates)

    def fit_context(self) -> tuple[float, float] | None:
        """(seconds per cached token per row, per query-key pair) fitted to the kept forwards
        (class docstring, "Context"); None while they do not spread enough (the rates in use
        stay: 0 before any fit, the last fit's after one)."""
        pts = []  # (rows · dc, positions · dc, dt, dc): centred on the shape's own means
        for (rows, positions), window in self._context_samples.items():
            if len(window) >= 4:
                mc = sum(c for c, _ in window) / len(window)
                mt = sum(t for _, t in window) / len(window)
                pts += [(rows * (c - mc), positions * (c - mc), t - mt, c - mc) for c, t in window]
        if len(pts) < CONTEXT_MIN_FORWARDS or (sum(p[3] ** 2 for p in pts) / len(pts)) ** 0.5 < CONTEXT_MIN_SD:
            return None

        def fit(sample) -> tuple[float, float]:
            s11 = sum(x1 * x1 for x1, _, _, _ in sample)
            s22 = sum(x2 * x2 for _, x2, _, _ in sample)
            s12 = sum(x1 * x2 for x1, x2, _, _ in sample)
            s1y = sum(x1 * y for x1, _, y, _ in sample)
            s2y = sum(x2 * y for _, x2, y, _ in sample)
            det = s11 * s22 - s12 * s12
            if det > CONTEXT_SEPARABLE * s11 * s22:  # shapes of different positions per row: both rates
                a, b = (s22 * s1y - s12 * s2y) / det, (s11 * s2y - s12 * s1y) / det
                if a >= 0 and b >= 0:
                    return a, b
                if a < 0:
                    return 0.0, max(0.0, s2y / s22)
                return max(0.0, s1y / s11), 0.0
            # one combined rate: rows + CONTEXT_QUERY_SHARE · positions per cached token
            sxx = s11 + 2 * CONTEXT_QUERY_SHARE * s12 + CONTEXT_QUERY_SHARE ** 2 * s22
            a = max(0.0, (s1y + CONTEXT_QUERY_SHARE * s2y) / sxx) if sxx > 0 else 0.0
            return a, CONTEXT_QUERY_SHARE * a

        a, b = fit(pts)
        resid = sorted(abs(y - a * x1 - b * x2) for x1, x2, y, _ in pts)
        mad = resid[len(resid) // 2]
        if mad > 0:
            kept = [p for p in pts if abs(p[2] - a * p[0] - b * p[1]) <= 3 * 1.4826 * mad]
            if len(kept) >= CONTEXT_MIN_FORWARDS:
                a, b = fit(kept)
        return a, b

    def _set_context_rates(self, row_s: float, query_s: float) -> None:
        """Re-express what is kept at context 0 under new rates (class docstring, "Context")."""
        d_row, d_query = row_s - self.context_row_s, query_s - self.context_query_s
        if d_row == 0 and d_query == 0:
            return
        self.version += 1
        self._changed()
        self.context_row_s, self.context_query_s = row_s, query_s
        for shape, raw in self._recent_raw.items():
            window = self._recent.get(shape)
            if window is not None:
                window.clear()
                window.extend(t - self._context_s((u1, u2)) for t, u1, u2 in raw)
        for curve, units in ((self.verify, self._point_units), (self._served_curve, self._served_units)):
            for positions, (u1, u2) in units.items():
                e = curve._verify.get(positions)
                if e is not None and e.value is not None:
                    e.value = max(0.0, e.value - d_row * u1 - d_query * u2)
        self._changed()

    def _median_recent(self, shape: tuple, seconds: float, units: tuple[float, float] | None = None) -> float:
        """Record ``seconds`` for ``shape``; the median of its last :data:`RECENT_FORWARDS` (class
        docstring, "Outliers"). ``units``: a verify forward's (rows · context, positions · context);
        it is kept at context 0 (class docstring, "Context").

        Raises:
            ValueError: ``seconds`` negative or not finite.
        """
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        window = self._recent.setdefault(shape, collections.deque(maxlen=RECENT_FORWARDS))
        if units is not None:
            self._recent_raw.setdefault(shape, collections.deque(maxlen=RECENT_FORWARDS)).append(
                (float(seconds), *units))
            seconds = seconds - self._context_s(units)
        window.append(float(seconds))
        return statistics.median(window)

    def observe_verify(self, rows: int, positions: int, seconds: float, *, prefill: bool = False,
                       calibration: bool = False, context: float | None = None) -> None:
        """One batched verify forward of ``rows`` sessions and ``positions`` positions took ``seconds``.

        ``prefill``: the forward fed more positions than its rows' blocks can hold (a prompt's
        prefill in it; :meth:`BatchKController.observe_tick` says so when positions > rows ·
        (largest k_max + 1)). Such a forward prices catch-ups (:meth:`catchup_s`) and counts in
        :attr:`min_positions_per_row`, but is not put on the verify curve that prices decode
        steps (class docstring, "Prefill forwards are not decode forwards").

        ``context``: the mean tokens its rows held in the target's KV cache before it (None:
        unknown, taken as the pricing context): it is kept at context 0 and fits the context rates
        (class docstring, "Context").

        ``calibration``: a start-up calibration forward (one session on a dummy sequence,
        :meth:`specdec.control.batch_sessions.BatchKSessions.join`): on the curve, but not in
        :attr:`min_positions_per_row`, which says whether a decode forward of the replica's
        traffic was measured (``measure_first``).

        Raises:
            ValueError: ``rows < 1`` or ``positions < rows``, or ``seconds`` negative or not finite.
        """
        if rows < 1 or positions < rows:
            raise ValueError(f"need 1 <= rows <= positions, got rows={rows}, positions={positions}")
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        if context is not None and not 0 <= context < float("inf"):
            raise ValueError(f"context must be finite and >= 0, got {context}")
        self.version += 1
        self._changed()
        try:
            self._observe_verify(rows, positions, seconds, prefill, calibration, context)
        finally:
            self._changed()

    def _observe_verify(self, rows: int, positions: int, seconds: float, prefill: bool, calibration: bool,
                        context: float | None) -> None:
        """:meth:`observe_verify` after its checks (what pricing derived is forgotten around it)."""
        raw = seconds
        if context is not None and not prefill and not calibration:
            if not self._context_set:
                self.context = float(context)
            self._observe_context(rows, positions, context, seconds)
        units = self._units(rows, positions, context)
        # a stale price above a fresher forward of more positions: this forward replaces its samples
        # (class docstring, "Stale points")
        replace = not prefill and self._fresh_cap(rows, positions) < self._price_at(rows, positions)
        self._forwards += 1
        if not calibration:
            self.min_positions_per_row = min(self.min_positions_per_row, positions / rows)
        if positions >= 16:
            self._cheapest_per_position = min(self._cheapest_per_position, raw / positions)
        if prefill:
            self._prefill_n += 1
            return
        if calibration:
            if positions not in self._calibrated:
                self._calibrated.add(positions)
                self.shapes_version += 1
        else:
            if rows == 1 and positions in self._calibrated and positions not in self._superseded:
                # the first one-row forward of this count measured in service supersedes the
                # calibration's (one row too; class docstring, "Calibration is a prior of the
                # shapes"); a forward of more rows first keeps the curve point its row term needs
                self._superseded.add(positions)
                self._drop_window(("verify", 1, positions))
                self._drop_point(positions)
            if positions not in self._served:
                self.shapes_version += 1
            self._served[positions] = self._served.get(positions, 0) + 1
        if replace:
            self._drop_window(("verify", rows, positions))
            self._drop_point(positions)
        self._seen[("verify", rows, positions)] = self._seen[("point", positions)] = self._forwards
        # at context 0 a forward can come out below 0 where the fitted rates overshoot its context (a tiny
        # model's 3-ms forward at 250 cached tokens); its window keeps the sign, the curves are seconds >= 0
        seconds = max(0.0, self._median_recent(("verify", rows, positions), seconds, units))
        if not calibration:
            self._served_curve.observe_verify(positions, seconds)
            self._track_units(self._served_units, self._served_curve, positions, units)
            self._track_units(self._served_rows, self._served_curve, positions, float(rows))
        base = self._point_rows.get(positions, 1.0)
        if rows - base >= 1 and positions in self.verify._verify:
            residual = (seconds - self.verify.verify_s(positions)) / (rows - base)
            self._row_n += 1
            self._row_s += max(0.2, 1.0 / self._row_n) * (max(residual, 0.0) - self._row_s)
        self.verify.observe_verify(positions, seconds)
        self._track_units(self._point_units, self.verify, positions, units)
        self._track_units(self._point_rows, self.verify, positions, float(rows))
        point = self.verify._verify[positions]
        if point.n == self.THIN_SAMPLES:
            # measured often enough to stand for itself (verify_s): from here on at the median of its
            # forwards, not at an EWMA that started on its first one (a contended 0.40 s where the
            # next two took 0.077 s left the point at 0.198 s, above the line it is no longer capped on)
            point.value = seconds
            self.verify.points_changed()
            self._point_rows[positions] = float(rows)
            raw_window = self._recent_raw.get(("verify", rows, positions))
            if raw_window:
                self._point_units[positions] = (sum(u[1] for u in raw_window) / len(raw_window),
                                                sum(u[2] for u in raw_window) / len(raw_window))

    @staticmethod
    def _track_units(kept: dict, curve: CostModel, positions: int, units) -> None:
        """Follow what fed ``curve``'s point at ``positions`` (its context units, a tuple, or its rows, a
        float) with the point's own EWMA weights (class docstring, "Context" and "Rows a point was
        measured at")."""
        e = curve._verify[positions]
        old = kept.get(positions)
        w = 1.0 if old is None or e.n == 1 else max(e.weight, 1.0 / e.n)
        if w == 1.0:
            kept[positions] = units
        elif isinstance(units, tuple):
            kept[positions] = (old[0] + w * (units[0] - old[0]), old[1] + w * (units[1] - old[1]))
        else:
            kept[positions] = old + w * (units - old)

    def observe_draft(self, rows: int, seconds: float) -> None:
        """One batched draft forward (one draft position) of ``rows`` sessions took ``seconds``
        (the curve is fed the median of its recent ones: class docstring, "Outliers")."""
        self.version += 1
        try:
            self.draft.observe_verify(rows, self._median_recent(("draft", rows), seconds))
        finally:
            self._changed()

    #: A positions count measured fewer times than this is "thin": priced at no more than the
    #: line fitted to the well-measured counts, or below all of them at no more than the least
    #: of them (:meth:`verify_s`).
    THIN_SAMPLES = 3

    def verify_s(self, rows: int, positions: int, *, optimistic: bool = False) -> float:
        """One batched verify forward of ``rows`` sessions and ``positions`` positions (s).

        A positions count measured by the start-up calibration and never in service costs at most
        what the fewest positions above it measured in service cost (the curve never decreases),
        and with ``optimistic`` a count never measured in service costs at most its price on the
        curve of the forwards measured in service alone: the price a probe of unmeasured shapes
        is chosen at (class docstring, "Calibration is a prior of the shapes").

        A positions count measured fewer than :attr:`THIN_SAMPLES` times is priced at most at the
        least-squares line (weighted by samples) through the counts measured at least that often,
        when there are two such counts. Why: the controller only re-measures the counts it runs,
        so one contended forward at a count it then stops running is never corrected. Served
        (w8a8 pair, one client, acceptance 0.98), the first K = 2 step's 3-position forward took
        0.204 s where 1 and 2 positions took 0.128 and 0.14 s over hundreds of forwards; priced
        at 0.204, K = 2 never paid again and the client held K = 1 for 120 steps (1.17x plain
        decoding where K = 2-4 gave 1.4-1.5x). An underpriced count is run and measured, so the
        cap corrects itself after a few forwards (the asymmetry of :meth:`catchup_s`).

        The cap is no lower than the curve can be: the dearest well-measured count at or below
        ``positions`` (the curve never decreases). **A thin count below every well-measured count
        is not capped on the line**: there the line is extrapolated downwards from forwards that are not its
        shape (a lone client's 1-position K = 0 forward against the 5 positions of its K = 4 steps
        and the 8 of eight clients' K = 0 forwards, measured at 8 rows), and it underpriced the
        smallest counts, which are K = 0's: in process on the 2-core Zen 3 (w7a8 pair,
        ``inprocess-s20-bg2``) the line priced a lone client's 1-position forward at 0.056 s where
        it measured 0.077 s, K = 0 at 17.9 tokens/s against 16.7 for K = 3, and once at K = 0 the
        draft's growing catch-up over the request's shrinking rest held it there: 32 of 32 steps
        at K = 0 in three rounds, 0.80x fixed K = 4. Earlier the cap was floored there on the line
        through the origin from the smallest well-measured count (``t_lo · positions / p_lo``),
        which priced an int4 1-position forward measured at 0.19 s at 0.085 s (a line bent by one
        contended forward, 0.26, 0.29 and 0.88 s at 3, 4, 5 positions, crossed zero at 1
        position). Such a count, and every count below the least well-measured one, costs at most
        what that least count costs (the curve never decreases): a small count measured once in
        a contended forward (0.40 s where it costs 0.077) is priced no higher than the 0.125 s of
        the 5 positions measured often, so K = 0 can still be chosen and run, which measures it
        (nothing else would in process, where no goodput guard explores K = 0 by default).

        A shape of several rows measured at least :attr:`THIN_SAMPLES` times as it is (``rows``
        and ``positions``) is priced at the median of its recent forwards (class docstring,
        "Outliers"), not on the curve plus the row term: the curve's point at ``positions`` was
        measured at those rows already, so adding ``row_s`` for every row beyond the first counts
        the rows twice. Session 13's 2-core EPYC (w8a8 pair, 8 clients x 128 tokens,
        docs/bench/batching/inprocess-s13-batch-main/): ``row_s`` learned 0.005 s from a 4-row
        forward, and the 8 x 1 forward of K = 0, measured at 0.18-0.19 s, was priced 0.229 s;
        the model then found K = 4 for the code tenant 1.1-1.3x K = 0 and ran it (and K = 1) on
        33 + 13 steps: 0.78x the K = 0 arm's tokens/s.

        A price from stale samples costs at most a fresh count of more positions at the same rows
        (class docstring, "Stale points").
        """
        return min(self._price_at(rows, positions, optimistic), self._fresh_cap(rows, positions, optimistic))

    def _price_at(self, rows: int, positions: int, optimistic: bool = False) -> float:
        """:meth:`_price` at the pricing context (class docstring, "Context"); never below 0 (a window
        holding a forward that came out below 0 at context 0, priced at a shorter context)."""
        return self._memo(("at", rows, positions, bool(optimistic)), lambda: max(
            0.0, self._price(rows, positions, optimistic) + self._context_term(rows, positions)))

    def _price(self, rows: int, positions: int, optimistic: bool = False) -> float:
        """:meth:`verify_s` before "Stale points" and at context 0 (class docstring)."""
        if rows > 1:
            window = self._recent.get(("verify", rows, positions))
            if window is not None and len(window) >= self.THIN_SAMPLES:
                return statistics.median(window)
        # (seconds, rows they were measured at) of each price this count may take; the row term is
        # added per candidate, for the rows beyond its own (class docstring, "Rows a point was measured at")
        cands = [(self.verify.verify_s(positions), self._rows_behind("point", positions))]
        e = self.verify._verify.get(positions)
        lo = self._least_well_measured()
        if positions < lo < float("inf"):  # below every well-measured count: no dearer than the least of them
            cands.append((self.verify._verify[lo].value, self._point_rows.get(lo, 1.0)))
        elif e is not None and e.value is not None and e.n < self.THIN_SAMPLES:
            line = self._well_measured_line()
            if line is not None:
                wm = self._well_measured()
                base = sum(self._point_rows.get(p, 1.0) * n for p, _, n in wm) / sum(n for _, _, n in wm)
                cands.append((max(line[0] + line[1] * positions, self._well_measured_floor(positions)), base))
        if positions not in self._served and self._served:
            above = [p for p in self._served if p > positions]
            if above and positions in self._calibrated:
                cands.append((self.verify.verify_s(min(above)), self._rows_behind("point", min(above))))
            if optimistic:
                cands.append((self._served_curve.verify_s(positions), self._rows_behind("served", positions)))
        return min(t + self._row_s * max(0.0, rows - base) for t, base in cands)

    def _rows_behind(self, curve: str, positions: int) -> float:
        """:meth:`_curve_rows` of the verify curve (``"point"``) or the served curve (``"served"``)."""
        rows_by_p, points = ((self._point_rows, self.verify) if curve == "point"
                             else (self._served_rows, self._served_curve))
        return self._memo(("rows", curve, positions), lambda: self._curve_rows(rows_by_p, points, positions))

    @staticmethod
    def _curve_rows(rows_by_p: dict[int, float], curve: CostModel, positions: int) -> float:
        """The rows behind ``curve``'s price at ``positions``, from the points that price uses
        (:meth:`CostModel.verify_s`): its own, the smallest's below them, interpolated between two,
        the dearest's above them (1 with no point; class docstring, "Rows a point was measured at")."""
        pts = curve.verify_points()
        if not pts:
            return 1.0
        rows = {p: rows_by_p.get(p, 1.0) for p, _ in pts}
        if positions in rows:
            return rows[positions]
        if positions < pts[0][0] or len(pts) == 1:
            return rows[pts[0][0]]
        for (p0, _), (p1, _) in zip(pts, pts[1:]):
            if p0 < positions < p1:
                return rows[p0] + (rows[p1] - rows[p0]) * (positions - p0) / (p1 - p0)
        return rows[max(pts, key=lambda pt: pt[1])[0]] if curve.extrapolation == "monotone" else rows[pts[-1][0]]

    def _source(self, rows: int, positions: int) -> tuple | None:
        """The key in :attr:`_seen` of the samples :meth:`_price` prices ``(rows, positions)`` from: the
        shape's recent forwards (several rows, measured :attr:`THIN_SAMPLES` times as it is) or the
        curve's point; None for a count never measured (priced between or beside measured ones)."""
        shape = ("verify", rows, positions)
        if rows > 1 and len(self._recent.get(shape, ())) >= self.THIN_SAMPLES:
            return shape
        return ("point", positions) if positions in self.verify._verify else None

    def _age(self, rows: int, positions: int) -> int | None:
        """Verify forwards since the samples ``(rows, positions)`` is priced from were last
        observed (None: priced from no samples of its own)."""
        seen = self._seen.get(self._source(rows, positions))
        return None if seen is None else self._forwards - seen

    def _fresh_cap(self, rows: int, positions: int, optimistic: bool = False) -> float:
        """When ``(rows, positions)`` is priced from stale samples (more than :data:`STALE_FORWARDS`
        verify forwards old), the least price at ``rows`` (at the pricing context, :meth:`_price_at`) of a
        count of more positions priced from fresh ones; inf otherwise (class docstring, "Stale points")."""
        age = self._age(rows, positions)
        if age is None or age <= STALE_FORWARDS:
            return float("inf")
        fresh = self._memo(("fresh", rows), lambda: [p for p in self.verify._verify
                                                     if (a := self._age(rows, p)) is not None and a <= STALE_FORWARDS])
        return min((self._price_at(rows, p, optimistic) for p in fresh if p > positions), default=float("inf"))

    def served(self, positions: int) -> bool:
        """Whether a decode forward of ``positions`` positions was measured in service (not
        only by the start-up calibration)."""
        return positions in self._served

    def calibration_unserved(self) -> bool:
        """Whether a positions count measured by the start-up calibration was never measured in
        service (else the optimistic prices are the measured ones)."""
        return bool(self._calibrated - self._served.keys())

    def optimistic(self) -> "OptimisticPrices":
        """This model's prices with every positions count never measured in service priced at
        most on the curve of the service's forwards alone (:meth:`verify_s` ``optimistic``):
        what a probe is chosen at."""
        return OptimisticPrices(self)

    def measured_verify_s(self, positions: int) -> float | None:
        """The curve's seconds at ``positions`` (at the pricing context) when that count was measured
        at least :attr:`THIN_SAMPLES` times (no interpolation, no prior); None otherwise."""
        e = self.verify._verify.get(positions)
        return (e.value + self._context_term(1, positions) if e is not None and e.value is not None
                and e.n >= self.THIN_SAMPLES else None)

    def _well_measured(self) -> list[tuple[int, float, int]]:
        """(positions, seconds, forwards) of every verify count measured at least :attr:`THIN_SAMPLES` times."""
        return self._memo("well", lambda: [(p, e.value, e.n) for p, e in self.verify._verify.items()
                                           if e.value is not None and e.n >= self.THIN_SAMPLES])

    def _least_well_measured(self) -> float:
        """The smallest positions count measured at least :attr:`THIN_SAMPLES` times (inf: none)."""
        return self._memo("least", lambda: min((p for p, _, _ in self._well_measured()), default=float("inf")))

    def _well_measured_floor(self, positions: int) -> float:
        """The least a forward of ``positions`` positions can cost on a never-decreasing curve
        through the well-measured counts (:meth:`verify_s`): the dearest of them at or below
        ``positions`` (0 when there is none; :meth:`verify_s` asks only above the least)."""
        return max((t for p, t, _ in self._well_measured() if p <= positions), default=0.0)

    def _well_measured_line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the sample-weighted least-squares line through the verify counts
        measured at least :attr:`THIN_SAMPLES` times; None with fewer than two such counts."""
        return self._memo("line", self._fit_well_measured_line)

    def _fit_well_measured_line(self) -> tuple[float, float] | None:
        pts = self._well_measured()
        if len(pts) < 2:
            return None
        w = sum(n for _, _, n in pts)
        mp = sum(p * n for p, _, n in pts) / w
        mt = sum(t * n for _, t, n in pts) / w
        var = sum(n * (p - mp) ** 2 for p, _, n in pts)
        slope = max(sum(n * (p - mp) * (t - mt) for p, t, n in pts) / var, 0.0)
        return mt - slope * mp, slope

    def draft_s(self, rows: int) -> float:
        """One batched draft forward of ``rows`` sessions (s). Before any draft forward is
        measured: ``prior_draft_s / prior_verify_s`` of a measured verify forward of ``rows``
        rows and positions (the priors' ratio, not the draft's absolute prior against a
        measured verify: with tiny models verifying in 3 ms, the 10 ms prior made every K > 0
        look 4x dearer than it was, so under load the draft was never run and never measured)."""
        if rows <= 0:
            return 0.0
        measured = self._draft_points()
        if not measured:
            return self._prior_ratio * self.verify_s(rows, rows)
        seconds = self.draft.verify_s(rows)
        most = max(int(r) for r in measured)
        if rows > most and self._catchup_rate is not None:  # class docstring, "Draft rows above the measured"
            top = self.draft.verify_s(most)
            seconds = max(seconds, min(top + (rows - most) * self._catchup_rate, top * rows / most))
        return seconds

    def observe_catchup(self, tokens: int, seconds: float) -> None:
        """A session behind by ``tokens`` tokens spent ``seconds`` catching its draft up (its
        first drafting step's seconds beyond its own draft forwards; class docstring).

        Raises:
            ValueError: ``tokens < 1`` or ``seconds`` negative or not finite.
        """
        if tokens < 1 or not 0 <= seconds < float("inf"):
            raise ValueError(f"need tokens >= 1 and 0 <= seconds < inf, got {tokens}, {seconds}")
        rate = seconds / tokens
        self.version += 1
        self._changed()
        self._catchup_rate = rate if self._catchup_rate is None else self._catchup_rate + 0.3 * (
            rate - self._catchup_rate)

    def catchup_s(self, tokens: int) -> float:
        """Seconds to feed ``tokens`` positions the draft is behind by (class docstring; 0 for none)."""
        if tokens <= 0:
            return 0.0
        if self._catchup_rate is not None:
            return self._catchup_rate * int(tokens)
        return self._catchup_model_s(int(tokens))

    def _draft_points(self) -> dict:
        """The draft curve's points (rows -> seconds, as its snapshot's ``verify_s``)."""
        return self._memo("draft", lambda: self.draft.snapshot()["verify_s"])

    def _catchup_model_s(self, tokens: int) -> float:
        measured = self._draft_points()
        rows = max((int(r) for r in measured), default=1)
        verify = self.verify_s(rows, rows)  # 0 s where a forward measured 0 s or a context refit clamped it
        ratio = self.draft_s(rows) / verify if verify > 0 else self._prior_ratio
        if self._cheapest_per_position < float("inf"):
            return int(tokens) * self._cheapest_per_position * ratio
        return self.verify.verify_s(int(tokens)) * ratio

    def step_s(self, ks: Sequence[int], drafted: Sequence[bool], memo: dict | None = None, *,
               optimistic: bool = False) -> float:
        """Seconds of one batched step where session s drafts ``ks[s]`` tokens (0: plain decoding).

        Args:
            ks: K per session.
            drafted: whether session s's drafts need draft forwards (False for prompt lookup).
            memo: a dict of forward prices kept while no observation comes in (as
                :meth:`prices`): each forward's price is computed once in it; one memo per
                ``optimistic``.
            optimistic: verify forwards at :meth:`verify_s`'s ``optimistic`` price.
        """
        drafting = [k for k, d in zip(ks, drafted) if d and k > 0]
        draft_rows = [sum(1 for k in drafting if k > j) for j in range(max(drafting, default=0))]
        return self.shape_s(len(ks), sum(k + 1 for k in ks), draft_rows, memo, optimistic=optimistic)

    def prices(self, optimistic: bool = False) -> dict:
        """The memo of forward prices (:meth:`shape_s`) shared by every decision made at the current
        :attr:`version` (a new dict once it moves): the decision of a tick and its probes' what-ifs
        (:meth:`specdec.control.batch_controller.BatchKController.probe_k`) price the same forwards
        once; one memo per ``optimistic``."""
        if self._prices[0] != self.version:
            self._prices = (self.version, {})
        return self._prices[1].setdefault(bool(optimistic), {})

    def shape_s(self, rows: int, positions: int, draft_rows: Sequence[int], memo: dict | None = None, *,
                optimistic: bool = False) -> float:
        """:meth:`step_s` of a step given by its shape: one verify forward of ``rows`` rows and
        ``positions`` positions (Σ (K_s + 1)) after one draft forward of ``draft_rows[j]`` rows per
        draft position j (the sessions drafting more than j tokens; each > 0). The same seconds,
        summed in the same order, as :meth:`step_s` of any sessions of that shape; what
        :func:`specdec.control.batch_choice.choose_batch_ks` prices a candidate at from its
        tenants' counts without listing the sessions."""
        memo = {} if memo is None else memo
        t = 0.0
        for r in draft_rows:
            got = memo.get(("d", r))
            if got is None:
                got = memo[("d", r)] = self.draft_s(r)
            t += got
        key = ("v", rows, positions)
        got = memo.get(key)
        if got is None:
            got = memo[key] = self.verify_s(rows, positions, optimistic=optimistic)
        return t + got

    def snapshot(self) -> dict:
        """The model's state for traces and statistics: the curves' points (verify seconds at context 0,
        class docstring "Context"; add ``(context_row_s · rows + context_query_s · positions) · context``
        for a price), the row term, the draft's points, the catch-up rate, the context rates and the
        pricing context."""
        return {"verify_s_by_positions": self.verify.snapshot()["verify_s"], "verify_row_s": self._row_s,
                "draft_s_by_rows": self.draft.snapshot()["verify_s"], "catchup_s_per_token": self._catchup_rate,
                "prefill_forwards": self._prefill_n, "verify_rows_by_positions": dict(self._point_rows),
                "context_row_s": self.context_row_s,
                "context_query_s": self.context_query_s, "context": self.context,
                "verify_positions_served": sorted(self._served)}


class OptimisticPrices:
    """A :class:`BatchCostModel`'s step prices with the verify forwards of positions counts never
    measured in service priced on the service's forwards alone (:meth:`BatchCostModel.optimistic`); what
    :func:`specdec.control.batch_choice.choose_batch_ks` needs of a cost model (``shape_s``, ``prices``; ``step_s`` as the model's)."""

    def __init__(self, cost: BatchCostModel):
        self.cost = cost

    @property
    def version(self) -> int:
        return self.cost.version

    def step_s(self, ks: Sequence[int], drafted: Sequence[bool], memo: dict | None = None) -> float:
        return self.cost.step_s(ks, drafted, memo, optimistic=True)

    def shape_s(self, rows: int, positions: int, draft_rows: Sequence[int], memo: dict | None = None) -> float:
        return self.cost.shape_s(rows, positions, draft_rows, memo, optimistic=True)

    def prices(self) -> dict:
        return self.cost.prices(optimistic=True)
