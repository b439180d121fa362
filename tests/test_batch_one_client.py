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
              guard: GoodputGuard | None = None) -> tuple[str, float, BatchKSessions]:
    """One adaptive client (K up to 4: the local preset's default_max_k) on code (drafts accepted at rate ``alpha``), served with
    the goodput guard as `specdec serve` runs it: its first step's target forward also prefills
    the ``prompt`` (1 row, prompt + K + 1 positions, ``prefill_s`` seconds), every later one
    costs the decode curve above, and a step at K > 0 after K = 0 steps (or the prompt) first
    feeds the draft what it is behind by; ``slow``: step index -> seconds of that step's verify
    forward (contention); ``guard``: the goodput guard's settings (default GoodputGuard()). Returns (K per step as digits, tokens/s, sessions)."""
    clock = _Clock()
    c = BatchKController(budget=64, clock=clock, cost=cost)
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


#: K per step of the 128-token main job, whatever its first forward cost: K = 1 on the priors (the
#: first block rejected, the verify curve still the prior's), one step at K = 0 once a 2-position
#: verify is measured with alpha-hat near the prior, at once a probe (no acceptance evidence yet)
#: and K = 1-2 as alpha-hat rises, the guard's 12-step exploration of K = 0, then K = 2-4
MAIN_JOB_KS = "1102211111111122000000000000222222223323333333333334"


@pytest.mark.parametrize("prefill_s", [2.6, 8.0, 30.0])
def test_one_client_on_code_speculates_whatever_its_prefill_cost(prefill_s):
    """The int4 main job (one client, code, acceptance 0.95, 40-token prompt, 128 tokens): its
    first forward (prompt prefill) measured 2-2.6 s warm and up to 10.7 s in a fresh process.
    With that forward on the verify curve, a 2-position verify was interpolated at
    0.19 + (X - 0.19) / 41 s between it and the K = 0 forward: from X ≈ 5 s no K > 0 paid even
    at the probe's alpha 0.9, so no probe ran and the job ran all 128 tokens at K = 0
    (1.03 tokens/step measured, 2 of 3 runs). A prefill forward is kept off the decode curve:
    the same 52 steps (2.46 tokens/step) whatever it cost, K = 0 on one step and on the goodput
    guard's exploration only."""
    ks, _, live = _main_job(prefill_s)
    assert ks == MAIN_JOB_KS and ks[:4] == "1102" and ks[16:28] == "0" * 12
    assert {k: ks.count(str(k)) for k in "01234"} == {"0": 13, "1": 11, "2": 13, "3": 14, "4": 1}
    assert live.probes == 1 and live.guards["default"].explorations == 1 and live.guards["default"].vetoes == 0
    cost = live.controller.cost.snapshot()
    assert cost["prefill_forwards"] == 1 and sorted(cost["verify_s_by_positions"]) == [1, 2, 3, 4, 5]
    assert cost["catchup_s_per_token"] == pytest.approx(0.0173125)


class _Before(BatchCostModel):
    """The batch cost model as it was: prefill forwards on its verify curve, a catch-up priced at
    no less than the model's price however cheap the measured ones."""

    def observe_verify(self, rows, positions, seconds, *, prefill=False):
        super().observe_verify(rows, positions, seconds)

    def catchup_s(self, tokens):
        measured = 0.0 if self._catchup_rate is None else self._catchup_rate * tokens
        return max(measured, self._catchup_model_s(tokens)) if tokens > 0 else 0.0


def test_the_prefill_forward_on_the_verify_curve_held_the_main_job_at_k0():
    """The same main job with the cost model as it was: with a warm 2.6 s prefill it speculated
    (52 steps), with an 8 s one it ran 1 step at K = 1 and 127 at K = 0 (1.00 tokens/step, no
    probe: none paid at alpha 0.9)."""
    ks, _, live = _main_job(2.6, cost=_Before(max_positions=4096))
    assert len(ks) == 52 and live.probes == 1
    ks, _, live = _main_job(8.0, cost=_Before(max_positions=4096))
    assert ks == "1" + "0" * 127 and live.probes == 0


def test_one_contended_step_does_not_hold_the_main_job_at_k0():
    """The main job with one step slowed by another process (its 2-position verify forward 2 s at
    step 8, where the others take 0.2-0.3 s): the goodput guard counts it at twice its mean spec
    step, so its comparison after the 12-step exploration keeps speculation (55 steps); counted
    in full it vetoed speculation for the rest of the request (105 steps, 1.2 tokens/step)."""
    ks, _, live = _main_job(2.6, slow={8: 2.0})
    assert ks == "1102211112222222" + "0" * 12 + "2" * 27 and live.guards["default"].vetoes == 0
    ks, _, live = _main_job(2.6, slow={8: 2.0}, guard=GoodputGuard(outlier_clip=float("inf")))
    assert len(ks) == 105 and ks.count("0") == 89 and live.guards["default"].vetoes == 1
