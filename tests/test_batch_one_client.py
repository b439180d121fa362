"""K under load for one client alone (the main job): whatever its first forward cost, a client on
code with the int4 demo pair's cost curves speculates after a few steps. Fake costs, a fake clock."""

from __future__ import annotations

import pytest

from specdec.control.batch_k import BatchCostModel, BatchKController, BatchKSessions, GoodputGuard
from specdec.types import BatchShape
from specdec.testing.sim import BeattyDrafts

#: the int4 demo pair served on the loaded 2-core CPU (the main job's batch-K trace): a verify
#: forward of p decode positions 0.19 + 0.033 (p - 1) s (0.19, 0.21, 0.25, 0.29 s measured at
#: 1..4), a draft forward 0.085 s, the draft's catch-up 0.016 s per token it is behind (its
#: 42-token prompt fed in 0.77 s on the first drafting step)
VERIFY1, VERIFY_SLOPE, DRAFT, CATCHUP = 0.19, 0.033, 0.085, 0.016


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _main_job(prefill_s: float, *, prompt: int = 40, max_tokens: int = 128, alpha: float = 0.95,
              cost: BatchCostModel | None = None, slow: dict[int, float] | None = None,
              guard: GoodputGuard | None = None, optimism: float = 1.0) -> tuple[str, float, BatchKSessions]:
    """One adaptive client (K up to 4: the local preset's default_max_k) on code (drafts accepted at rate ``alpha``), served with
    the goodput guard as `specdec serve` runs it: its first step's target forward also prefills
    the ``prompt`` (1 row, prompt + K + 1 positions, ``prefill_s`` seconds), every later one
    costs the decode curve above, and a step at K > 0 after K = 0 steps (or the prompt) first
    feeds the draft what it is behind by; ``slow``: step index -> seconds of that step's verify
    forward (contention); ``guard``: the goodput guard's settings (default GoodputGuard()). Returns (K per step as digits, tokens/s, sessions)."""
    clock = _Clock()
    c = BatchKController(budget=64, clock=clock, cost=cost, optimism=optimism)
    live = BatchKSessions(c, guard=guard or GoodputGuard())
    live.join("s", "default", "draft", k_range=(0, 4), prompt_tokens=prompt, max_tokens=max_tokens)
    sched = live.schedule("default", 4)
    drafts = BeattyDrafts(alpha)
    left, behind, step, ks = max_tokens, prompt, 0, []
    while left > 0:
        k = sched()
        accepted = drafts.accepted(k)
        first = step == 0
        verify = prefill_s if first else (slow or {}).get(step, VERIFY1 + VERIFY_SLOPE * k)
        draft_s = k * DRAFT + (behind * CATCHUP if k > 0 else 0.0)
        step += 1
        live.observe_step("s", k, accepted, BatchShape(step, 1, k + 1 + (prompt if first else 0), verify),
                          [(1, DRAFT)] * k, draft_s=draft_s, verify_s=verify + 0.02)
        clock.t += draft_s + verify + 0.02
        behind = 0 if k > 0 else behind + accepted + 1
        left -= min(accepted + 1, left)
        ks.append(k)
    live.leave("s")
    return "".join(map(str, ks)), max_tokens / (clock.t - 1000.0), live


#: K per step of the 128-token main job, whatever its first forward cost: K = 3 on the priors
#: and the optimistic acceptance of no evidence (0.79; the first block rejected), K = 2 as the
#: bound tightens, one step at K = 0 (its 1-position forward, unmeasured, priced on the line
#: through the origin below the 4-position one: run and measured), then K = 1-4 as evidence
#: arrives and K = 4 from the 11th step; no exploration of K = 0 in the request (the guard's
#: first waits 64 spec steps). Before optimism and the guard's wait:
#: "1102211111111122000000000000222222223323333333333334" (52 steps, 13 at K = 0)
MAIN_JOB_KS = "32012233443444444444444444444444"


@pytest.mark.parametrize("prefill_s", [2.6, 8.0, 30.0])
def test_one_client_on_code_speculates_whatever_its_prefill_cost(prefill_s):
    """The int4 main job (one client, code, acceptance 0.95, 40-token prompt, 128 tokens): its
    first forward (prompt prefill) measured 2-2.6 s warm and up to 10.7 s in a fresh process.
    With that forward on the verify curve, a 2-position verify was interpolated at
    0.19 + (X - 0.19) / 41 s between it and the K = 0 forward: from X ≈ 5 s no K > 0 paid even
    at the probe's alpha 0.9, so no probe ran and the job ran all 128 tokens at K = 0
    (1.03 tokens/step measured, 2 of 3 runs). A prefill forward is kept off the decode curve:
    the same 32 steps (4.0 tokens/step) whatever it cost, K = 0 on one step only."""
    ks, _, live = _main_job(prefill_s)
    assert ks == MAIN_JOB_KS and ks[:4] == "3201"
    assert {k: ks.count(str(k)) for k in "01234"} == {"0": 1, "1": 1, "2": 3, "3": 4, "4": 23}
    assert live.probes == 0 and live.guards["default"].explorations == 0 and live.guards["default"].vetoes == 0
    cost = live.controller.cost.snapshot()
    assert cost["prefill_forwards"] == 1 and sorted(cost["verify_s_by_positions"]) == [1, 2, 3, 4, 5]
    assert cost["catchup_s_per_token"] == pytest.approx(0.021625)


def test_fresh_servers_first_request_reaches_k4_within_a_dozen_steps():
    """What each change of the fresh server's first request does, on the main job above (prefill
    2.6 s): the controller before them (no optimism, the guard exploring K = 0 after its first
    12 spec steps) ran 52 steps, 13 at K = 0 (12 of them the guard's exploration) and reached
    K = 4 only on its last step; with the guard's first exploration waiting 64 spec steps
    alone, 43 steps (K = 1 for 9 steps while α̂ climbs from its prior 0.5); with optimism alone
    (decisions at the upper confidence bound of the tenant's own evidence), K = 4 from the 9th
    step but the guard's 12 steps at K = 0 (41 steps); both: 32 steps, 1.05x the tokens/s of
    before (on these int4 costs, verify 0.19 s + 0.033 s per position and a 0.085 s draft
    forward, K = 2-4 differ little; the fresh served w8a8 run's cost curve is flatter)."""
    before, tps_before, _ = _main_job(2.6, optimism=0.0, guard=GoodputGuard(first_explore=12))
    assert before == "1102211111111122000000000000222222223323333333333334"
    wait_only, _, _ = _main_job(2.6, optimism=0.0)
    assert wait_only == "1102211111111122222222223323333333333334333"
    optimism_only, _, _ = _main_job(2.6, guard=GoodputGuard(first_explore=12))
    assert optimism_only == "32012233443444000000000000444444444444444"
    both, tps, _ = _main_job(2.6)
    assert both == MAIN_JOB_KS and both.index("4") == 8 and round(tps / tps_before, 2) == 1.05


class _Before(BatchCostModel):
    """The batch cost model as it was: prefill forwards on its verify curve, a catch-up priced at
    no less than the model's price however cheap the measured ones."""

    def observe_verify(self, rows, positions, seconds, *, prefill=False, context=None):
        super().observe_verify(rows, positions, seconds)  # context-blind, as it was

    def catchup_s(self, tokens):
        measured = 0.0 if self._catchup_rate is None else self._catchup_rate * tokens
        return max(measured, self._catchup_model_s(tokens)) if tokens > 0 else 0.0


def test_the_prefill_forward_on_the_verify_curve_held_the_main_job_at_k0():
    """The same main job with the cost model as it was: with a warm 2.6 s prefill it speculated
    (50 steps), with an 8 s one it ran 1 step at K = 3 and 127 at K = 0 (1.00 tokens/step, no
    probe: none paid at alpha 0.9)."""
    ks, _, live = _main_job(2.6, cost=_Before(max_positions=4096))
    assert len(ks) == 50 and live.probes == 0
    ks, _, live = _main_job(8.0, cost=_Before(max_positions=4096))
    assert ks == "3" + "0" * 127 and live.probes == 0


def _calibrated() -> BatchCostModel:
    """A cost model after a start-up calibration measured the 1-position forward (3 times, 0.19 s)."""
    cost = BatchCostModel(max_positions=4096)
    for _ in range(3):
        cost.observe_verify(1, 1, VERIFY1, calibration=True)
    return cost


def test_one_contended_step_does_not_hold_the_main_job_at_k0():
    """The main job with one step slowed by another process (its verify forward 3 s at step 10,
    where the others take 0.2-0.3 s), its 1-position forward measured by the start-up
    calibration as served, the guard exploring K = 0 after its first 12 spec steps: the guard
    counts the slow step at twice its mean spec step, so speculation's measured goodput stays
    above what plain decoding could reach by its measured 1-position forward (1 / 0.19 s = 5.3,
    the guard's ``plain_bound``), and both explorations due are skipped (31 steps, none at
    K = 0); counted in full, the slow step pulls speculation's goodput below the bound, the
    exploration runs and vetoes speculation for the rest of the request (90 steps, 75 at
    K = 0). With the served guard (first exploration after 64 spec steps) the request ends
    before any exploration (31 steps). The slow 5-position forward no longer holds the model at
    K = 0 either (the curve takes the median of its recent forwards; before, its EWMA priced
    K = 4 dear and held K = 0 for two steps: "320122334430044444444444444444444")."""
    early = GoodputGuard(first_explore=12)
    ks, _, live = _main_job(2.6, slow={10: 3.0}, guard=early, cost=_calibrated())
    assert ks == "3212233443444444444444444444444" and live.guards["default"].vetoes == 0
    assert live.guards["default"].explorations == 0 and live.guards["default"].skipped == 2
    ks, _, live = _main_job(2.6, slow={10: 3.0}, guard=GoodputGuard(outlier_clip=float("inf"), first_explore=12),
                            cost=_calibrated())
    assert len(ks) == 90 and ks.count("0") == 75 and live.guards["default"].vetoes == 1
    ks, _, live = _main_job(2.6, slow={10: 3.0}, cost=_calibrated())
    assert ks == "3212233443444444444444444444444" and live.guards["default"].explorations == 0
