"""The batch cost model prices a forward shape at the median of its recent forwards, so one
forward slowed by another process does not hold a client at K = 0 (where the draft never runs
and its price is never corrected). Fake costs: the served w8a8 demo pair's
K trace (one client; docs/bench/batching/served-s11/), a fake clock."""

from __future__ import annotations

import pytest

from specdec.control.batch_cost import RECENT_FORWARDS
from specdec.control.batch_k import BatchCostModel, BatchKController, BatchKSessions, GoodputGuard
from specdec.testing.sim import BeattyDrafts
from specdec.types import BatchShape

#: one client on code, served w8a8 pair (the draft replica's K trace after its start-up
#: calibration, load 1-11): a verify forward of p decode positions (s), a one-row draft forward
VERIFY = {1: 0.082, 2: 0.093, 3: 0.097, 4: 0.138, 5: 0.123}
DRAFT = 0.0375


class _Ewma(BatchCostModel):
    """The model before: every forward's own seconds fed to the EWMAs."""

    def _median_recent(self, shape, seconds, units=None):
        return float(seconds)


def _calibrated(cls=BatchCostModel) -> BatchCostModel:
    """After the start-up calibration: K = 4..0 three times each (1..5 positions, one draft row)."""
    cost = cls(max_positions=4096)
    for k in range(4, -1, -1):
        for _ in range(3):
            cost.observe_verify(1, k + 1, VERIFY[k + 1], calibration=True)
            if k:
                cost.observe_draft(1, DRAFT)
    return cost


def _one_client(cost: BatchCostModel, slow_drafts: dict[int, float], steps: int = 40) -> str:
    """K per step (digits) of one adaptive client (K <= 4, acceptance 0.97) whose first draft
    forward at the given steps took the given seconds (another process preempted it)."""
    live = BatchKSessions(BatchKController(budget=64, cost=cost), guard=GoodputGuard())
    live.join("s", "default", "draft", k_range=(0, 4), prompt_tokens=0, max_tokens=4 * steps)
    sched = live.schedule("default", 4)
    drafts = BeattyDrafts(0.97)
    ks = []
    for step in range(steps):
        k = sched()
        accepted = drafts.accepted(k)
        forwards = [(1, slow_drafts.get(step, DRAFT))] + [(1, DRAFT)] * (k - 1) if k else []
        verify = VERIFY[k + 1]
        live.observe_step("s", k, accepted, BatchShape(step + 1, 1, k + 1, verify), forwards,
                          draft_s=sum(s for _, s in forwards), verify_s=verify + 0.01)
        ks.append(k)
    return "".join(map(str, ks))


def test_one_preempted_draft_forward_does_not_hold_one_client_at_k0():
    """One draft forward that another process slowed to 0.45 s (the served trace: 0.035-0.045 s
    otherwise). Fed to the EWMA, the draft forward's price rose to 0.12 s, K = 0 looked best
    (the 1-position verify 0.082 s), and at K = 0 the draft never runs again: K = 0 to the end
    (served: 128 steps at K = 0, 9.2 tokens/s, where the unbatched path ran K = 4 at 12.0). On
    the median of its recent forwards the price stays 0.0375 s and the client keeps K = 4 (K = 2
    on its first steps, while its acceptance estimate is young)."""
    assert _one_client(_calibrated(), {6: 0.45}) == "2222" + "4" * 36
    assert _one_client(_calibrated(_Ewma), {6: 0.45}) == "2222444" + "0" * 33
    assert _one_client(_calibrated(), {}) == _one_client(_calibrated(_Ewma), {}) == "2222" + "4" * 36


def test_a_lasting_slowdown_moves_the_price_within_half_the_window():
    """The median follows a lasting change: after RECENT_FORWARDS // 2 + 1 forwards at the new cost."""
    cost = _calibrated()
    for _ in range(RECENT_FORWARDS // 2):
        cost.observe_draft(1, 0.2)
    assert cost.draft.verify_s(1) == pytest.approx(DRAFT)
    cost.observe_draft(1, 0.2)
    assert cost.draft.verify_s(1) > DRAFT
    with pytest.raises(ValueError, match="finite and >= 0"):
        cost.observe_draft(1, -1.0)
