"""Measured goodput inside a request: the per-step K of one in-process request under its tenant's
:class:`specdec.control.goodput_guard.GoodputGuard`.

:class:`specdec.control.controller.KController` decides K once per request, from its cost model
and acceptance estimate. On the 2-core EPYC with the w8a8 target and the int4 draft that model
overrated speculation on creative text: α̂ 0.61, K = 1 predicted 1.03x plain decoding and
measured 0.91x (session 10, ``specdec bench``, poem-sea, 32 tokens). Served, the draft replica's
per-tenant goodput guard overrules the model (:mod:`specdec.control.batch_sessions`); in process
nothing did. :class:`GuardedK` is that guard for one in-process request: the ``k`` the engine asks
before every step (:meth:`specdec.engine.engine.SpeculativeEngine.start` takes a callable), which
is the decided K unless the tenant's guard forces K = 0 (an exploration of plain decoding or a
veto: speculation measured slower than plain decoding), and which feeds the guard what every
step measured:

- regime ``spec`` for a step that drafted (K > 0), ``plain`` for one that did not;
- tokens = accepted drafts + 1, seconds = the step's draft + verify wall seconds
  (:class:`specdec.types.SpeculationStats` deltas): a drafting step after plain steps carries the
  draft's catch-up on the tokens decoded meanwhile, a real cost of going back to speculation;
- the request's first step is left out (it carries both prompt prefills), and so are the steps
  of a probe (:attr:`KDecision.probe`: the controller's own measurement of a tenant it holds at
  K = 0) and of a request decided at K = 0 (the engine opens no draft session then).

With ``retune`` (:meth:`KController.in_request_k`, ``in_request_retune``), the K of a measured
request is re-chosen before every step from the request's own acceptance so far: a fresh
tenant whose prior said K = 2 on code moves to a longer K within its first request instead of
waiting for the next one. The guard's K = 0 overrides it as before.

The guard is the tenant's, kept by the controller across requests (:meth:`KController.guarded_k`),
so a veto holds the tenant's next requests at K = 0 too, for the guard's ``hold`` steps, and a
recheck after it measures speculation again with fresh steps.

Not thread-safe: one request's engine loop calls it.
"""

from __future__ import annotations

from typing import Callable

from specdec.control.goodput_guard import GoodputGuard

__all__ = ["GuardedK", "in_request_guard"]


def in_request_guard() -> GoodputGuard:
    """The guard settings for in-process requests of tens of steps (a 32-token request is 6-30
    steps on the demo pair): 4 fresh steps per regime before comparing, the first exploration of
    plain decoding after 4 speculating steps and compared as soon as it ends, later ones every
    16 spec steps (backing off to 128 while speculation keeps paying), a veto holds K = 0 for 64
    steps (doubling up to 256 while rechecks confirm it); a later exploration is skipped while
    speculation measures more than 1.25x the last exploration's plain steps (``skip_margin``)."""
    return GoodputGuard(min_steps=4, explore_every=16, first_explore=4, hold=64, max_backoff=4, margin=0.0,
                        decay=0.95, explore_backoff=8, outlier_clip=2.0, compare_on_explore_end=True,
                        skip_margin=0.25)


class GuardedK:
    """The per-step K of one request: ``k`` unless ``guard`` forces K = 0 (module docstring).

    Args:
        k: the decided K (an int) or a per-step schedule (a callable, e.g. a probe's
            :func:`specdec.control.k_decision.k_schedule`).
        guard: the tenant's guard, or None (then ``k`` as it is: nothing is measured).
        measure: False: pass ``k`` through without consulting or feeding the guard (a probe).
        plain_bound: returns the most tokens/s plain decoding could reach by measured forwards,
            or None when unknown (:meth:`GoodputGuard.record`'s ``plain_bound``).
        retune: ``(stats, k) -> k'``, the K for the next step given the request's live stats and
            the K in use (>= 1); None: the decided K throughout. Only for a measured request
            whose schedule asks K > 0.

    Attributes:
        ks: the K returned for every step so far (before the engine shrinks it to the room left).

    Call :meth:`attach` with the generation's live stats before its first step.
    """

    def __init__(self, k: int | Callable[[], int], guard: GoodputGuard | None, *, measure: bool = True,
                 plain_bound: Callable[[], float | None] | None = None,
                 retune: Callable[[object, int], int] | None = None):
        self._k = k
        self.retune = retune
        self._tuned: int | None = None  # the re-chosen K (retune), None before the first
        self.guard = guard
        self.measure = measure and guard is not None
        self.plain_bound = plain_bound
        self.ks: list[int] = []
        self._stats = None
        self._prev: tuple[int, int, int, float, float] | None = None

    def attach(self, stats) -> "GuardedK":
        """Follow ``stats`` (a :class:`specdec.types.SpeculationStats`, updated after every step)."""
        self._stats = stats
        self._prev = self._snapshot()
        return self

    def _snapshot(self) -> tuple[int, int, int, float, float]:
        s = self._stats
        return s.steps, s.proposed, s.accepted, s.draft_time_s, s.verify_time_s

    def _observe(self) -> None:
        if self._stats is None:
            return
        cur, prev = self._snapshot(), self._prev
        self._prev = cur
        if cur[0] != prev[0] + 1 or prev[0] == 0:  # nothing new, several steps, or the prefill step
            return
        seconds = (cur[3] - prev[3]) + (cur[4] - prev[4])
        if not seconds > 0:
            return
        regime = "spec" if cur[1] > prev[1] else "plain"
        bound = self.plain_bound() if self.plain_bound is not None else None
        self.guard.record(regime, float(cur[2] - prev[2] + 1), seconds, plain_bound=bound)

    def __call__(self) -> int:
        k = int(self._k()) if callable(self._k) else int(self._k)
        if self.measure:
            self._observe()
            if k > 0 and self.retune is not None and self._stats is not None:
                self._tuned = int(self.retune(self._stats, k if self._tuned is None else self._tuned))
                k = self._tuned
            if k > 0 and self.guard.forced:
                k = 0
        self.ks.append(k)
        return k
