"""Measured goodput of speculating against plain decoding, per tenant: overrules the cost model.

Part of :mod:`specdec.control.batch_k`; one :class:`GoodputGuard` per tenant lives in
:class:`specdec.control.batch_sessions.BatchKSessions`.
"""

from __future__ import annotations

from typing import Sequence


class GoodputGuard:
    """Measured goodput of speculating against plain decoding: overrules the cost model when
    measurement contradicts it.

    The batch cost model predicts a step from the seconds of the batched forwards it saw. Served,
    part of a step's wall time is in no forward it measures: sessions stepping in their own
    threads at K > 0 fall into groups that alternate drafting and verifying (fewer rows per
    target forward, each group's draft forwards competing with the other's verify for the same
    cores), a block that misses the gathering window waits a whole forward, and the draft's
    prefill and catch-up are left out of the draft costs. On the 2-core CPU with the int4 demo
    pair the model predicted K > 0 to pay while K = 0 measured 1.7x faster (served, two
    tenants, 8 clients). So, as a rate controller backs off when measurement contradicts its
    model, this guard compares what the two regimes *measured*:

        goodput(regime) = Σ n_s · tokens_s / Σ seconds_s      (tokens per second of the batch)

    over the adaptive sessions' steps s (tokens_s = accepted + 1, seconds_s = drafting + the
    verify round trip as the session saw them, n_s = sessions stepping concurrently when it
    ended: a session's rate tokens_s / seconds_s times the sessions running is the batch's rate,
    so a batch that drains while one regime runs does not flatter it), each sum decayed by
    ``decay`` per step recorded in that regime (memory ~ 1 / (1 - decay) steps).

    **One guard per tenant** (:class:`BatchKSessions`): tenant t's guard gets the steps of
    *every* adaptive session (any tenant's), each in regime ``spec`` when the model had t at
    K > 0 and ``plain`` when it had t at K = 0 or t's guard forces K = 0 (a probe's steps and a
    generation's first step, which also prefills the target, count in no guard). So it compares
    the whole batch's goodput with and without t's speculation, including what t's speculation
    costs the other tenants (their steps slow down too), and a veto holds only t at K = 0: a
    tenant whose speculation pays keeps its K. Explorations of different tenants do not
    overlap (``may_explore`` of :meth:`record`): with two tenants exploring at once, each
    guard's ``plain`` would hold the other's K = 0 as well.

    Policy, in adaptive steps (summed over all sessions):

    - **explore**: while ``spec`` runs, when ``plain`` has fewer than ``min_steps`` fresh steps
      (the first time after ``first_explore`` spec steps) and then every ``explore_every`` spec steps,
      force K = 0 for ``min_steps`` steps, so that there is a fresh measured ``plain`` to compare
      with (an exploration due while ``may_explore`` is False waits for the next ``spec`` step).
      **Explorations back off while they confirm speculation**: an exploration whose comparison
      (the next ``spec`` step's) finds speculation paying doubles the spacing to the next one,
      up to ``explore_every · explore_backoff`` spec steps; a veto sets it back to
      ``explore_every``. Each exploration runs ``min_steps`` steps at K = 0, which cost a
      tenant whose speculation pays 1.5x about 4 % of its tokens at a fixed 64-step spacing
      (12 of every 76 steps at 2/3 the speed); backed off, ``min_steps / (explore_every ·
      explore_backoff + min_steps)`` of the steps in the long run (12 / 524 ≈ 2 %, about
      0.8 % of the tokens, with the defaults). Every spec step is compared with the last
      exploration's ``plain``, so speculation that turns slower is vetoed within steps of it
      (its decayed goodput falls below the measured ``plain``); only plain decoding that turns
      faster waits for the next exploration, at most ``explore_every · explore_backoff`` spec
      steps away. **The first exploration waits for evidence** (``first_explore`` spec steps,
      ``explore_every`` by default): exploring after ``min_steps`` spec steps cost a fresh
      server's first request (one client on code, 128 tokens, about 30 steps at K = 4 on the
      w8a8 pair) 12 steps at K = 0, a third of its steps, before any comparison was due; a
      speculation that measures slower than plain decoding is still vetoed within
      ``first_explore + min_steps`` steps;
    - **veto**: once both regimes hold ``min_steps`` fresh steps and
      ``goodput(spec) < goodput(plain) · (1 - margin)``, force K = 0 for ``hold`` steps (doubled
      after each veto that a recheck confirms, up to ``hold · max_backoff``), then let the
      model's K run again with ``spec``'s old measurement cleared, so that ``min_steps`` fresh
      steps are compared again (a recheck);
    - otherwise the model's choice stands; a veto's hold falls back to ``hold`` once a recheck
      finds speculation paying.

    - **an exploration that cannot find plain decoding faster is skipped** (``plain_bound`` of
      :meth:`record`): the goodput plain decoding would at most reach, from the target's
      well-measured forwards alone (``sessions / verify_s(sessions rows, sessions positions)``:
      no drafting, no round trip, no scheduling, all of which a plain step also pays). When
      ``spec``'s measured goodput is above it, the exploration due now is not run and counts as
      one that confirmed speculation (the spacing doubles; :attr:`skipped`). One client on
      code with the w8a8 demo pair served (a start-up-calibrated 1-position verify, 0.085 s):
      spec measured ~11.9 tokens/s against a bound of 11.8 at most, so its first exploration,
      due in a fresh server's second request, cost that request 12 of its ~40 steps at K = 0
      for a comparison that could not have vetoed. Where the bound is unknown (that forward
      not measured at least 3 times) or not beaten (under load: the step's wall time holds
      what no forward measures), explorations run as before.

    - **a batch of another size is another comparison** (``sessions`` of :meth:`record`): the
      batch's goodput grows with its sessions, so a regime measured at one batch size says
      nothing against the other regime at another. When a step ends with ``sessions`` more than
      ``resize_ratio`` times above or below a regime's (decayed) mean sessions, that regime's
      measurement is dropped (it is measured afresh, plain decoding by an exploration that waits
      ``first_explore`` spec steps as a fresh guard's does) and a veto's hold ends. Served (one
      tenant, w7a8 pair, 32-token requests): plain steps measured at 8 sessions (21.6 tokens/s
      for the batch) vetoed the next lone client's speculation (8.8 tokens/s at one session,
      where plain decoding gives ~7), holding it at K = 0 for the 28 steps left of its request.

    Not thread-safe (its owner locks).

    Args:
        min_steps: fresh steps per regime before comparing (≥ 1).
        explore_every: spec steps between explorations of K = 0 (≥ min_steps), the first spacing.
        first_explore: spec steps before the first exploration (≥ min_steps; None: ``explore_every``).
        explore_backoff: the spacing grows up to ``explore_every · explore_backoff`` while
            explorations confirm speculation (≥ 1; 1: a fixed spacing).
        hold: steps K = 0 is forced after a veto (≥ 1).
        max_backoff: the hold grows up to ``hold · max_backoff`` (≥ 1).
        margin: relative shortfall of ``spec`` that vetoes, in [0, 1).
        decay: per-step decay of a regime's sums, in (0, 1].
        outlier_clip: once a regime holds 3 fresh steps, a step's seconds count at most this
            many times the regime's (decayed) mean step (>= 1; ``float("inf")``: no clipping).
            On the shared CPU one step slowed by another process's burst (2 s among 0.4 s
            steps) was a sixth of the 12 spec steps' seconds: it vetoed the main job's
            speculation, which paid 1.3x, for the rest of its request.
        compare_on_explore_end: compare the regimes on an exploration's last step (see above).
        skip_margin: None (the default) or m >= 0: a later exploration (not the first) is also
            skipped, and counts as one that confirmed speculation, while the last exploration's
            fresh ``plain`` measurement is at least ``min_steps`` steps and ``spec``'s measured
            goodput is above it by more than m (``goodput(spec) > goodput(plain) · (1 + m)``).
            Every spec step is still compared with that ``plain`` (a veto as before); only plain
            decoding that turns faster by more than m goes unseen. In process
            (:func:`specdec.control.step_guard.in_request_guard`, m = 0.25): on the VNNI EPYC
            (w8a8 pair, code-prime, 128 tokens) the taught controller's request re-explored 4
            plain steps and a fresh one's 8 of its 34 steps while speculation measured ~1.5x
            the plain steps it had measured (``docs/bench/formats/bench-s13/adaptk/``).
        resize_ratio: a step whose ``sessions`` differ from a regime's mean sessions by more
            than this factor drops that regime's measurement (class docstring; > 1;
            ``float("inf")``: never).

    Raises:
        ValueError: a setting out of its range.
    """

    def __init__(self, *, min_steps: int = 12, explore_every: int = 64, hold: int = 96, max_backoff: int = 4,
                 margin: float = 0.0, decay: float = 0.97, explore_backoff: int = 8, outlier_clip: float = 2.0,
                 first_explore: int | None = None, compare_on_explore_end: bool = False,
                 skip_margin: float | None = None, resize_ratio: float = 1.5):
        if not resize_ratio > 1:
            raise ValueError(f"resize_ratio must be > 1, got {resize_ratio}")
        self.resize_ratio = float(resize_ratio)
        first_explore = explore_every if first_explore is None else first_explore
        if skip_margin is not None and not skip_margin >= 0:
            raise ValueError(f"skip_margin must be >= 0 or None, got {skip_margin}")
        self.skip_margin = None if skip_margin is None else float(skip_margin)
        if (min_steps < 1 or explore_every < min_steps or first_explore < min_steps or hold < 1 or max_backoff < 1
                or not 0 <= margin < 1 or not 0 < decay <= 1 or explore_backoff < 1 or not outlier_clip >= 1):
            raise ValueError("need min_steps >= 1, explore_every >= min_steps, first_explore >= min_steps, hold >= 1, "
                             "max_backoff >= 1, 0 <= margin < 1, 0 < decay <= 1, explore_backoff >= 1, outlier_clip >= 1; "
                             f"got {min_steps}, {explore_every}, {first_explore}, {hold}, {max_backoff}, {margin}, "
                             f"{decay}, {explore_backoff}, {outlier_clip}")
        self.first_explore = int(first_explore)
        self.compare_on_explore_end = bool(compare_on_explore_end)
        self.outlier_clip = float(outlier_clip)
        self.min_steps, self.explore_every, self.hold = int(min_steps), int(explore_every), int(hold)
        self.explore_backoff = int(explore_backoff)
        self._explore_spacing = self.explore_every  # spec steps before the next exploration
        self._explored = False  # an exploration ended and its comparison is still to come
        self.max_backoff, self.margin, self.decay = int(max_backoff), float(margin), float(decay)
        #: regime -> [decayed tokens, decayed seconds, fresh steps, decayed steps]
        self._sums = {"spec": [0.0, 0.0, 0, 0.0], "plain": [0.0, 0.0, 0, 0.0]}
        #: regime -> [decayed sessions, decayed steps] of the steps that gave their sessions
        self._sessions = {"spec": [0.0, 0.0], "plain": [0.0, 0.0]}
        self._plain_unmeasured = False  # plain was dropped for a batch of another size
        #: measurements dropped for a batch of another size (class docstring)
        self.resized = 0
        self._forced_left = 0  # steps left with K = 0 forced
        self._forced_why: str | None = None  # "explore" or "veto"
        self._since_explore = 0  # spec steps since the last exploration
        self._hold = self.hold
        self._rechecking = False  # spec was cleared after a veto: the next comparison is a recheck
        #: vetoes and explorations started, for statistics and tests
        self.vetoes = 0
        self.explorations = 0
        #: explorations skipped: speculation measured above the plain bound (class docstring)
        self.skipped = 0

    def fresh(self) -> "GoodputGuard":
        """A new guard with this one's settings and nothing measured (one per tenant)."""
        return GoodputGuard(min_steps=self.min_steps, explore_every=self.explore_every, hold=self.hold,
                            max_backoff=self.max_backoff, margin=self.margin, decay=self.decay,
                            explore_backoff=self.explore_backoff, outlier_clip=self.outlier_clip,
                            first_explore=self.first_explore,
                            compare_on_explore_end=self.compare_on_explore_end, skip_margin=self.skip_margin,
                            resize_ratio=self.resize_ratio)

    @property
    def forced(self) -> bool:
        """Whether K = 0 is forced now (an exploration or a veto)."""
        return self._forced_left > 0

    @property
    def exploring(self) -> bool:
        """Whether K = 0 is forced now for an exploration (not a veto)."""
        return self._forced_left > 0 and self._forced_why == "explore"

    def goodput(self, regime: str) -> float | None:
        """Measured tokens per step-second of ``regime`` ("spec" or "plain"), None before any step."""
        tok, sec, _, _ = self._sums[regime]
        return tok / sec if sec > 0 else None

    def steps(self, regime: str) -> int:
        """Fresh steps measured in ``regime``."""
        return self._sums[regime][2]

    def mean_sessions(self, regime: str) -> float | None:
        """The (decayed) mean sessions of ``regime``'s steps that gave theirs (None: none did)."""
        n, w = self._sessions[regime]
        return n / w if w > 0 else None

    def _drop(self, regime: str) -> None:
        self._sums[regime] = [0.0, 0.0, 0, 0.0]
        self._sessions[regime] = [0.0, 0.0]

    def _resize(self, sessions: float) -> None:
        """Drop each regime measured at a batch size more than ``resize_ratio`` away from
        ``sessions``, and end a veto's hold (class docstring)."""
        dropped = False
        for regime in ("spec", "plain"):
            mean = self.mean_sessions(regime)
            if mean is None or self.steps(regime) == 0:
                continue
            if max(mean, sessions) > self.resize_ratio * min(mean, sessions):
                self._drop(regime)
                dropped = True
                if regime == "plain":  # measured afresh as a fresh guard's first exploration
                    self._plain_unmeasured, self._since_explore = True, 0
        if dropped:
            self.resized += 1
            self._explored = self._rechecking = False
            if self._forced_left > 0 and self._forced_why == "veto":
                self._forced_left, self._forced_why, self._hold = 0, None, self.hold

    def record(self, regime: str, tokens: float, seconds: float, may_explore: bool = True,
               plain_bound: float | None = None, sessions: float | None = None) -> None:
        """One adaptive step of ``regime`` emitted ``tokens`` tokens (weighted: n_s · tokens_s of
        the class docstring) in ``seconds`` seconds of wall time; then the policy (class
        docstring) moves on by one step. ``may_explore`` False: an exploration due now waits
        (another tenant's guard is exploring). ``plain_bound``: the most tokens/s plain decoding
        of the batch could reach by the target's measured forwards (None: unknown); an
        exploration due now is skipped while ``spec`` measures above it (class docstring).
        ``sessions``: the sessions stepping when it ended (None: unknown, no batch-size check); a
        regime measured at a batch size more than ``resize_ratio`` away is dropped first
        (class docstring).

        Raises:
            ValueError: an unknown regime, tokens < 1, seconds not finite and > 0, or sessions < 1.
        """
        if regime not in self._sums:
            raise ValueError(f"regime must be 'spec' or 'plain', got {regime!r}")
        if tokens < 1 or not 0 < seconds < float("inf"):
            raise ValueError(f"need tokens >= 1 and 0 < seconds < inf, got {tokens}, {seconds}")
        if sessions is not None:
            if not sessions >= 1:
                raise ValueError(f"sessions must be >= 1, got {sessions}")
            self._resize(float(sessions))
            n = self._sessions[regime]
            n[0], n[1] = n[0] * self.decay + float(sessions), n[1] * self.decay + 1.0
        s = self._sums[regime]
        if s[2] >= 3:  # a contended step counts at most outlier_clip x the regime's mean step
            seconds = min(seconds, self.outlier_clip * s[1] / s[3])
        s[0], s[1], s[2], s[3] = (s[0] * self.decay + tokens, s[1] * self.decay + seconds, s[2] + 1,
                                  s[3] * self.decay + 1.0)
        if self._forced_left > 0:
            self._forced_left -= 1
            ended = self._forced_why if self._forced_left == 0 else None
            if ended == "veto":
                self._drop("spec")  # recheck speculation with fresh steps
                self._rechecking = True
            if self._forced_left == 0:
                self._forced_why = None
            if ended == "explore" and self.compare_on_explore_end:
                self._compare()
            return
        if regime != "spec":
            return
        self._since_explore += 1
        ns, npl = self.steps("spec"), self.steps("plain")
        if self._compare():
            return
        # nothing measured of plain yet (or dropped for a batch of another size)
        first = npl < self.min_steps and (not self.explorations or self._plain_unmeasured)
        if may_explore and ns >= self.min_steps and (
                (npl < self.min_steps and not first) or self._since_explore >= (
                    self.first_explore if first else self._explore_spacing)):
            spec = self.goodput("spec")
            if spec is not None and ((plain_bound is not None and spec > plain_bound) or self._plain_far_below(spec)):
                # plain decoding cannot be faster than what speculation measures: no exploration
                self._since_explore = 0
                self.skipped += 1
                self._explore_spacing = min(self._explore_spacing * 2, self.explore_every * self.explore_backoff)
                return
            self._drop("plain")  # explore with fresh steps
            self._plain_unmeasured = False
            self._since_explore = 0
            self.explorations += 1
            self._explored = npl >= self.min_steps  # a spaced one (not the first measurement)
            self._forced_left, self._forced_why = self.min_steps, "explore"

    def quiet_for(self, regime: str, steps: int) -> bool:
        """Whether the next ``steps`` :meth:`record` calls of ``regime`` without ``sessions`` would
        only add to the sums (and count a forcing down), leaving :attr:`forced`, :attr:`exploring`
        and the policy as they are whatever ``may_explore`` and ``plain_bound`` say: plain decoding
        while nothing is forced (a plain step never explores, vetoes or compares), or any regime
        while a forcing has more than ``steps`` steps left. Such steps can be recorded in one
        :meth:`record_quiet` call (in process) or held back and recorded later by
        :meth:`record_quiet_steps` (served: :class:`specdec.control.batch_sessions.BatchKSessions`)."""
        if self._forced_left > 0:
            return self._forced_left > steps
        return regime == "plain"

    def record_quiet(self, regime: str, tokens: "list[float]", seconds: float) -> None:
        """``len(tokens)`` steps of ``regime``, each as :meth:`record` (``regime``, ``tokens[i]``,
        ``seconds``) without ``sessions`` would record it, bit for bit, in one call: only where
        :meth:`quiet_for` (``regime``, ``len(tokens)``) holds (the in-process scheduler records
        every adaptive row of a tick in every tenant's guard: with many tenants mostly at K = 0,
        :class:`specdec.engine.batch_adaptive.TenantGuards` spent O(rows x tenants) full calls a
        tick).

        Raises:
            ValueError: an unknown regime, a token count < 1, seconds not finite and > 0, or the
                steps not quiet (:meth:`quiet_for`).
        """
        self.record_quiet_steps(regime, [(t, seconds, None) for t in tokens])

    def quiet_run(self, regime: str, limit: int, sessions: float | None = None) -> int:
        """How many of the next :meth:`record` calls of ``regime``, each with these ``sessions``
        (None: without), are quiet, at most ``limit`` (>= 0): they leave :attr:`forced`,
        :attr:`exploring` and every policy decision as they are whatever their tokens, seconds,
        ``may_explore`` and ``plain_bound`` (so :meth:`record_quiet_steps` may record them
        later, bit for bit). ``limit`` for plain decoding while nothing is forced (a batch-size
        drop, :meth:`_resize`, forces nothing then); while a forcing runs, its steps but the
        last (``forced_left - 1``), and during a veto only up to the first step whose
        ``sessions`` would drop a regime (that ends the veto), found by running the decayed
        sessions sums exactly as :meth:`record` would (O(steps) float operations).

        Raises:
            ValueError: an unknown regime.
        """
        if regime not in self._sums:
            raise ValueError(f"regime must be 'spec' or 'plain', got {regime!r}")
        if self._forced_left <= 0:
            return max(0, limit) if regime == "plain" else 0
        n = max(0, min(limit, self._forced_left - 1))
        if n == 0 or self._forced_why != "veto" or sessions is None:
            return n
        sf, r = float(sessions), self.resize_ratio
        if not sf >= 1:
            return 0  # record() raises on it
        other = "plain" if regime == "spec" else "spec"
        mean = self.mean_sessions(other)  # the other regime's: unchanged by these steps
        if mean is not None and self.steps(other) != 0 and max(mean, sf) > r * min(mean, sf):
            return 0
        a, w = self._sessions[regime]
        c, d = self._sums[regime][2], self.decay
        for j in range(n):
            if w > 0 and c != 0:
                mean = a / w
                if max(mean, sf) > r * min(mean, sf):
                    return j
            a, w, c = a * d + sf, w * d + 1.0, c + 1
        return n

    def record_quiet_steps(self, regime: str, steps: "Sequence[tuple[float, float, float | None]]") -> None:
        """``(tokens, seconds, sessions)`` steps of ``regime``, each as :meth:`record` (``regime``,
        tokens, seconds, sessions=sessions) would record it, bit for bit (the same float
        operations in the same order, a batch-size drop included), in one call: only for steps
        that are quiet (:meth:`quiet_run`: no forcing starts or ends, nothing explores, vetoes
        or compares, so ``may_explore`` and ``plain_bound`` do not matter). The served
        :class:`specdec.control.batch_sessions.BatchKSessions` holds back the steps of quiet
        guards and records them here before anything reads the guard. Nothing is recorded when
        it raises.

        Raises:
            ValueError: an unknown regime, a token count < 1, seconds not finite and > 0,
                sessions < 1, or the steps not quiet (a forcing with ``len(steps)`` or fewer steps
                left, speculation while nothing is forced, or a veto that a step's ``sessions``
                would end).
        """
        if regime not in self._sums:
            raise ValueError(f"regime must be 'spec' or 'plain', got {regime!r}")
        for tokens, seconds, sessions in steps:
            if not tokens >= 1 or not 0 < seconds < float("inf"):  # NaN fails both
                raise ValueError(f"need tokens >= 1 and 0 < seconds < inf, got {tokens}, {seconds}")
            if sessions is not None and not sessions >= 1:
                raise ValueError(f"sessions must be >= 1, got {sessions}")
        if not steps:
            return
        if not self.quiet_for(regime, len(steps)):
            raise ValueError(f"{len(steps)} {regime} steps are not quiet for this guard (quiet_run)")
        veto = self._forced_left > 0 and self._forced_why == "veto"
        other = "plain" if regime == "spec" else "spec"
        d, clip, r = self.decay, self.outlier_clip, self.resize_ratio
        om = self.mean_sessions(other) if self.steps(other) != 0 else None
        s0, s1, s2, s3 = self._sums[regime]
        a, w = self._sessions[regime]
        last, sf, hi, other_drops = None, 0.0, 0.0, False
        # the arithmetic of record(), in its order; max(m, x) > r * min(m, x) is written out as
        # (m > r * x if m >= x else x > r * m), and min(x, c) as (c if c < x else x): the same floats
        for tokens, seconds, sessions in steps:
            if sessions is not None:
                if sessions is not last:  # the other regime's check depends on the sessions alone
                    last, sf = sessions, float(sessions)
                    hi = r * sf
                    other_drops = om is not None and (om > hi if om >= sf else sf > r * om)
                if w > 0 and s2 != 0:
                    m = a / w
                    drops = other_drops or (m > hi if m >= sf else sf > r * m)
                else:
                    drops = other_drops
                if drops:
                    if veto:  # nothing written yet: the veto would end (no drop happened before, it would have raised)
                        raise ValueError("these steps are not quiet: a batch-size drop would end the veto (quiet_run)")
                    self._sums[regime] = [s0, s1, s2, s3]
                    self._sessions[regime] = [a, w]
                    self._resize(sf)  # rare: the whole of record()'s drop, then go on from its state
                    s0, s1, s2, s3 = self._sums[regime]
                    a, w = self._sessions[regime]
                    om = self.mean_sessions(other) if self.steps(other) != 0 else None
                    last = None
                a, w = a * d + sf, w * d + 1.0
            if s2 >= 3:
                c = clip * s1 / s3
                if c < seconds:
                    seconds = c
            s0, s1, s2, s3 = s0 * d + tokens, s1 * d + seconds, s2 + 1, s3 * d + 1.0
        s, n = self._sums[regime], self._sessions[regime]
        s[0], s[1], s[2], s[3] = s0, s1, s2, s3
        n[0], n[1] = a, w
        if self._forced_left > 0:
            self._forced_left -= len(steps)  # more than len(steps) were left: still forced

    def _plain_far_below(self, spec: float) -> bool:
        """Whether the last exploration's fresh ``plain`` is below ``spec`` by more than
        ``skip_margin`` (never with ``skip_margin`` None or too few fresh plain steps)."""
        if self.skip_margin is None or self.steps("plain") < self.min_steps:
            return False
        plain = self.goodput("plain")
        return plain is not None and spec > plain * (1.0 + self.skip_margin)

    def _compare(self) -> bool:
        """Compare the regimes once both hold ``min_steps`` fresh steps: veto (True) or keep."""
        if self.steps("spec") < self.min_steps or self.steps("plain") < self.min_steps:
            return False
        if self.goodput("spec") < self.goodput("plain") * (1.0 - self.margin):
            if self._rechecking:  # speculation lost again: hold longer
                self._hold = min(self._hold * 2, self.hold * self.max_backoff)
            self._rechecking = self._explored = False
            self._explore_spacing = self.explore_every
            self.vetoes += 1
            self._forced_left, self._forced_why = self._hold, "veto"
            return True
        if self._rechecking:
            self._rechecking, self._hold = False, self.hold
        if self._explored:  # the exploration confirmed speculation: explore less often
            self._explored = False
            self._explore_spacing = min(self._explore_spacing * 2, self.explore_every * self.explore_backoff)
        return False

    def snapshot(self) -> dict:
        """Plain data: goodput and fresh steps per regime, whether K = 0 is forced and why, counters."""
        return {"goodput_spec": self.goodput("spec"), "goodput_plain": self.goodput("plain"),
                "steps_spec": self.steps("spec"), "steps_plain": self.steps("plain"),
                "forced": self._forced_why if self.forced else None, "forced_left": self._forced_left,
                "vetoes": self.vetoes, "explorations": self.explorations, "skipped": self.skipped,
                "resized": self.resized,
                "explore_spacing": self._explore_spacing}
