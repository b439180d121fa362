"""Deterministic stand-ins for tests: a cost model that ignores measurements, drafts of a given
acceptance rate."""

from __future__ import annotations

import math
from typing import Callable

from specdec.control.cost_model import CostModel


class FrozenCostModel(CostModel):
    """A :class:`CostModel` that keeps its priors: observations are ignored.

    ``FrozenCostModel(verify_s=1.0, draft_s_per_token=c)`` is Leviathan et al.'s constant-cost
    model (step_time(k) = 1 + c·k), so K decisions depend on acceptance alone and tests on tiny
    models (whose draft costs as much as the target) stay deterministic.
    """

    def __init__(self, verify_s: float = 1.0, draft_s_per_token: float = 0.1, verify_slope: float = 0.0):
        super().__init__(prior_verify_s=verify_s, prior_verify_slope=verify_slope, prior_draft_s_per_token=draft_s_per_token)

    def observe_draft(self, k: int, seconds: float) -> None:
        pass

    def observe_verify(self, positions: int, seconds: float) -> None:
        pass

    def observe_round_trip(self, seconds: float) -> None:
        pass

    def observe_draft_block(self, drafted: int, seconds: float) -> None:
        pass

    def observe_draft_prefill(self, seconds: float) -> None:
        pass


def frozen_cost_model_factory(proposer: str) -> FrozenCostModel:
    """``cost_model_factory`` for :class:`specdec.control.controller.KController` (picklable)."""
    return FrozenCostModel()


class BeattyDrafts:
    """Deterministic drafts of acceptance rate ``alpha`` in [0, 1]: draft token n (counted over
    all steps) is accepted iff floor(n·α) > floor((n - 1)·α), a Beatty sequence, so exactly a
    fraction α of the drafted tokens is accepted in the long run, with no random draws."""

    def __init__(self, alpha: float):
        self.alpha, self.n = alpha, 0

    def accepted(self, k: int) -> int:
        """The accepted length of a block of ``k`` drafted tokens (0..k): drafts are consumed up
        to and including the first rejected one."""
        a = 0
        while a < k:
            self.n += 1
            if math.floor(self.n * self.alpha) == math.floor((self.n - 1) * self.alpha):
                break
            a += 1
        return a


def simulate_request(k: "int | Callable[[], int]", drafts: BeattyDrafts, tokens: int, *, verify_s: "Callable[[int], float]",
                     draft_s_per_token: float, stats=None, on_start: "Callable[[object], None] | None" = None):
    """Run one request's speculation loop on a deterministic cost/acceptance model, no model.

    Each step asks ``k`` (an int or the per-step callable a :class:`Generation` takes), shrinks it
    to the tokens left, drafts with ``drafts`` (accepted length by its Beatty sequence) and records
    the step in ``stats`` (a :class:`specdec.types.SpeculationStats`, new if None) with draft
    seconds ``K · draft_s_per_token`` and verify seconds ``verify_s(K + 1)``, as the engine does.
    ``on_start(stats)`` is called before the first step (e.g. :meth:`GuardedK.attach`).

    Returns:
        ``(ks, stats)``: the K of every step, and the stats; the request emits exactly ``tokens``.
    """
    from specdec.types import SpeculationStats

    stats = SpeculationStats() if stats is None else stats
    if on_start is not None:
        on_start(stats)
    ks, emitted = [], 0
    while emitted < tokens:
        want = int(k()) if callable(k) else int(k)
        kk = max(0, min(want, tokens - emitted - 1))
        accepted = drafts.accepted(kk) if kk > 0 else 0
        stats.record_step(kk, accepted, kk * draft_s_per_token, verify_s(kk + 1))
        ks.append(kk)
        emitted += accepted + 1
    return ks, stats
