"""Deterministic stand-ins for tests: a cost model that ignores measurements."""

from __future__ import annotations

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
