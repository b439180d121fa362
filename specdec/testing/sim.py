"""Deterministic stand-ins for tests: a cost model that ignores measurements, drafts of a given
acceptance rate."""

from __future__ import annotations

import math

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
