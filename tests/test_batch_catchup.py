"""K under load: leaving K = 0 costs the draft a catch-up, and the first decisions under load wait
for a measured decode forward. Fake costs and a fake clock (a simulated served batch)."""

from __future__ import annotations


import pytest

from specdec.control.batch_k import BatchCostModel, BatchKController, BatchKSessions, TenantLoad, choose_batch_ks
from specdec.control.objective import expected_tokens_per_step
from specdec.types import BatchShape
from specdec.testing.sim import BeattyDrafts


def test_catch_up_is_a_draft_prefill_priced_on_the_verify_curve():
    """catchup_s(n) = n x the fewest seconds per position of a verify forward measured at >= 16
    positions x draft_s(R) / verify_s(R, R), R the most rows a draft forward was measured at
    (before any such forward: the verify curve at n positions; the priors' ratio, 0.01 / 0.05
    at one row, before any draft forward). One cold forward does not bend it."""
    c = BatchCostModel()
    assert c.catchup_s(0) == 0.0
    assert c.catchup_s(40) == pytest.approx(c.verify.verify_s(40) * 0.01 / 0.05)
    for p, s in ((8, 0.28), (64, 0.84)):
        c.observe_verify(8, p, s)
    c.observe_draft(1, 0.15)
    c.observe_draft(8, 0.168)
    assert c.catchup_s(8) == pytest.approx(8 * 0.84 / 64 * 0.6)  # 64 positions in 0.84 s
    c.observe_verify(1, 57, 10.7)  # a cold first prefill: 0.19 s per position
    c.observe_verify(2, 32, 0.4)  # 0.0125 s per position: the cheapest
    assert c.catchup_s(200) == pytest.approx(200 * 0.0125 * 0.6)
    assert c.min_positions_per_row == 1.0  # the 8-row, 8-position forward: a decode forward


def _controller(draft0: float, **kw) -> BatchKController:
    """Measured: verify 0.2 + 0.01 s per position (8 rows at 8 and 64 positions), draft forwards
    draft0 + 0.003 s per row (4 and 8 rows); code accepted every draft of 20 steps at K = 4,
    creative one of four."""
    c = BatchKController(budget=64, **kw)
    for p in (8, 64):
        c.observe_tick(8, p, 0.2 + 0.01 * p, [])
    c.observe_tick(0, 0, 0.0, [(r, draft0 + 0.003 * r) for r in (4, 8)])
    for _ in range(20):
        c.observe_row("code", "draft", 4, 4)
        c.observe_row("creative", "draft", 4, 1)
    return c


def _rounds(live: BatchKSessions, keys: list, rounds: int) -> str:
    sched = {key: live.schedule(key[0], 4) for key in keys}
    out = []
    for rnd in range(rounds):
        ks = [sched[key]() for key in keys]
        p = sum(k + 1 for k in ks)
        shape = BatchShape(rnd, len(keys), p, 0.2 + 0.01 * p)
        for key, k in zip(keys, ks):
            live.observe_step(key, k, min(k, 4 if key[0] == "code" else 1), shape, ())
        out.append(f"{ks[0]}{ks[-1]}")
    return " ".join(out)


def test_leaving_k0_pays_the_catch_up_over_the_steps_left():
    """4 code + 4 creative sessions, 40-token prompts, costs where K = 1 for both gains 9 % a step
    (31.05 against 28.57 tokens/s) once the drafts are fed. With 24 tokens to generate, feeding
    each tenant's 160 prompt positions to the draft (0.84 s / 64 positions on the verify curve x
    the draft's cost ratio 0.44: 0.93 s) over the ~12 steps left at K = 1 costs more than it gains: K = 0 throughout,
    the catch-up charged grows with every K = 0 step (4 x 60 positions after 20 rounds), and no
    probe runs (even at α = 0.9 it would not pay). With 1000 tokens to generate the same catch-up
    is spread thin: K = 1 from the first step, as without it."""
    keys = [("code", i) for i in range(4)] + [("creative", i) for i in range(4)]
    runs = {}
    for max_tokens in (24, 1000, None):
        c = _controller(0.1)
        live = BatchKSessions(c)
        for key in keys:
            live.join(key, key[0], "draft", k_range=(0, 4), prompt_tokens=40 if max_tokens else 0,
                      max_tokens=max_tokens)
        runs[max_tokens] = (_rounds(live, keys, 20), c)
    ks, c = runs[24]
    assert ks == " ".join(["00"] * 20) and c.probes == 0 and c.probe_k("code", 4) == 0
    assert c.cost.catchup_s(160) == pytest.approx(160 * 0.84 / 64 * (0.1 + 0.024) / 0.28)
    # the last decision (before round 20's steps were observed): 4 x (40 + 19) positions behind
    assert c._loads["code"].catchup_s == pytest.approx(c.cost.catchup_s(4 * 59))
    assert c._loads["code"].tokens_left == 5.0  # 24 - 19 tokens at K = 0
    assert c.last.tokens_per_s == pytest.approx(8 / 0.28)
    without = runs[None][0]  # no prompt, no length known: nothing to charge (the old controller)
    assert without == "11 11 11 11 11 11 11 11 22 11 22 11 11 22 11 11 22 11 11 22"
    assert runs[1000][0] == without
    # the charge in the objective: K = 1 for both at 24 tokens left, catch-up of 160 positions
    cost = runs[1000][1].cost
    a = {t: runs[24][1].estimator.alpha((t, "draft")) for t in ("code", "creative")}
    loads = {t: TenantLoad(4, a[t], k_max=4, catchup_s=cost.catchup_s(160), tokens_left=24) for t in a}
    d = choose_batch_ks(loads, cost, 64)
    tokens = 4 * (expected_tokens_per_step(a["code"], 1) + expected_tokens_per_step(a["creative"], 1))
    steps = {t: 24 / expected_tokens_per_step(a[t], 1) for t in a}
    k1 = tokens / (cost.step_s([1] * 8, [True] * 8) + sum(cost.catchup_s(160) / steps[t] for t in a))
    assert d.ks == {"code": 0, "creative": 0} and k1 < d.tokens_per_s == pytest.approx(8 / 0.28)
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        choose_batch_ks(loads, cost, 64, horizon=0)


def test_no_speculation_under_load_before_a_decode_forward_is_measured():
    """Nothing measured but two prompts' prefill forwards (40 positions per row; an unmeasured
    draft forward costs the priors' 1/5 of a verify of as many rows): on the priors (and the
    optimistic acceptance 0.79 of no evidence) the controller would run 8 sessions at K = 2 (each
    feeding its prompt to the draft); it holds them at K = 0 until a decode-sized forward is
    measured, then decides on the costs. One session alone decides on the priors (it
    speculates, and so measures)."""
    def decide(measure_first: bool, sessions: int, forwards=()):
        c = BatchKController(budget=64, measure_first=measure_first)
        for rows, p, s in forwards:
            c.observe_tick(rows, p, s, [])
        n = {("code", "draft"): sessions // 2 or 1}
        if sessions > 1:
            n[("creative", "draft")] = sessions // 2
        return c.decide(n).ks

    assert decide(False, 8) == {"code": 2, "creative": 2}
    assert decide(True, 8) == {"code": 0, "creative": 0}
    assert decide(True, 8, [(1, 40, 0.5), (2, 80, 0.9)]) == {"code": 0, "creative": 0}
    assert decide(True, 1) == decide(False, 1) == {"code": 3}
    # a decode forward (8 rows, 8 positions) measured: the costs decide (flat: speculate)
    flat = [(1, 40, 0.32), (8, 8, 0.3)]
    assert decide(True, 8, flat) == decide(False, 8, flat) == {"code": 2, "creative": 2}


def _serve(policy, rounds: int, slots: list[str], *, max_tokens: int = 24, prompt: int = 40, draft0: float = 0.12,
           old: bool = False, alphas=None, warm: bool = False) -> tuple[float, dict[int, int], BatchKSessions | None]:
    """A served batch on a fake clock: each slot (tenant name) holds a session of ``max_tokens``
    tokens after a ``prompt``-token prompt, replaced by a new one when it ends; every round each
    session steps once. True costs: verify 0.2 + 0.01 s per position, draft forwards draft0 +
    0.003 s per row, and a draft that catches up (its prompt, then every token decoded at
    K = 0) on its next drafting step at 0.004 s per position. ``policy``: a fixed K, or "adaptive"
    (BatchKSessions; ``old``: as before catch-ups were charged: no prompt, no length known, and
    decisions on the priors; ``warm``: the replica measured 4- and 8-row draft forwards before).
    Returns (tokens/s, steps per K, the controller)."""
    drafts = {t: BeattyDrafts(a) for t, a in (alphas or {"code": 0.9, "creative": 0.75}).items()}
    live = None
    if policy == "adaptive":
        c = BatchKController(budget=64, measure_first=not old)
        if warm:
            c.observe_tick(0, 0, 0.0, [(r, draft0 + 0.003 * r) for r in (4, 8)])
        live = BatchKSessions(c)
    sessions: list[dict] = [None] * len(slots)
    serial = 0
    tokens, seconds, k_steps = 0, 0.0, {}

    def start(i):
        nonlocal serial
        serial += 1
        s = {"key": (slots[i], serial), "left": max_tokens, "behind": prompt, "sched": None}
        if live is not None:
            live.join(s["key"], slots[i], "draft", k_range=(0, 4), prompt_tokens=0 if old else prompt,
                      max_tokens=None if old else max_tokens)
            s["sched"] = live.schedule(slots[i], 4)
        sessions[i] = s

    for i in range(len(slots)):
        start(i)
    for rnd in range(rounds):
        ks = [s["sched"]() if s["sched"] else policy for s in sessions]
        catchup = sum(s["behind"] for s, k in zip(sessions, ks) if k > 0) * 0.004
        drafting = [sum(1 for k in ks if k > j) for j in range(max(ks))]
        draft_s = [draft0 + 0.003 * r for r in drafting]
        p = sum(k + 1 for k in ks)
        verify = 0.2 + 0.01 * p
        seconds += catchup + sum(draft_s) + verify
        for i, (s, k) in enumerate(zip(sessions, ks)):
            acc = drafts[slots[i]].accepted(k)
            n = min(acc + 1, s["left"])
            tokens += n
            s["left"] -= n
            s["behind"] = 0 if k > 0 else s["behind"] + 1
            k_steps[k] = k_steps.get(k, 0) + 1
            if live is not None:
                live.observe_step(s["key"], k, acc, BatchShape(rnd, len(slots), p, verify),
                                  [(r, d) for r, d in zip(drafting, draft_s)] if i == 0 else ())
        for i, s in enumerate(sessions):
            if s["left"] <= 0:
                if live is not None:
                    live.leave(s["key"])
                start(i)
    return tokens / seconds, dict(sorted(k_steps.items())), live


def test_served_like_two_tenants_8_clients_adaptive_at_least_k0_and_best_fixed_k():
    """The w8a8 served case on a fake clock: 8 clients (4 code α 0.9, 4 creative α 0.75), 24
    tokens each after a 40-token prompt, requests replaced as they end, 300 rounds; a draft
    forward costs 0.09-0.10 s, a verify 0.28 s at K = 0, and the draft catches up at 0.004 s per
    position. K = 0 is the best fixed K (K = 1 0.90x, K = 2 0.92x). Ignoring the catch-up, the
    model predicts K = 1 for both tenants slightly faster than K = 0: the controller as before
    ran 83 % of its steps at K = 1, 0.90x K = 0 (what the served w8a8 run measured: 0.88x; with
    today's optimistic acceptance and no catch-up charged: 96 %, 0.90x). Now: K = 0 from the
    first step, then 64 of its 2400 steps at K = 1-4 (no probe: the optimistic acceptance
    of little evidence tries K > 0 where probes did before), 0.99x K = 0 (with probes in place of optimism 0.98x); on a replica that has measured its
    draft forwards before (as in the benchmark, after the fixed-K arms) nothing pays and
    adaptive runs every step at K = 0: 1.00x."""
    slots = ["code", "creative"] * 4
    fixed = {k: _serve(k, 300, slots, draft0=0.08)[0] for k in (0, 1, 2)}
    assert [round(fixed[k] / fixed[0], 2) for k in (1, 2)] == [0.9, 0.92]
    old_tps, old_ks, _ = _serve("adaptive", 300, slots, draft0=0.08, old=True)
    assert old_ks == {0: 8, 1: 2304, 2: 80, 4: 8} and round(old_tps / fixed[0], 2) == 0.9
    tps, ks, live = _serve("adaptive", 300, slots, draft0=0.08)
    assert ks == {0: 2336, 1: 8, 2: 52, 4: 4} and live.probes == 0 and round(tps / fixed[0], 2) == 0.99
    tps, ks, live = _serve("adaptive", 300, slots, draft0=0.08, warm=True)
    assert ks == {0: 2400} and live.probes == 0 and tps == pytest.approx(fixed[0])


def test_one_client_on_code_still_speculates():
    """One client on code (α 0.95), 64 tokens per request after a 40-token prompt, the draft
    costing 0.03 s a forward: speculation pays (K = 4: 2.4x K = 0). Adaptive (the prompt's
    catch-up charged): its first step at K = 3 on the priors and the optimistic acceptance of
    no evidence (one session: no need to measure first), one step at K = 0 (the 1-position
    forward, not measured yet, priced on the line through the origin below the measured
    4-position one: it runs and is measured), then K = 2, 3, 3 and K = 4: 0.99x the best fixed
    K (before optimism: K = 1, then 199 steps at K = 4 after a probe, 1.00x)."""
    fixed = {k: _serve(k, 200, ["code"], max_tokens=64, draft0=0.03, alphas={"code": 0.95})[0] for k in (0, 2, 4)}
    tps, ks, live = _serve("adaptive", 200, ["code"], max_tokens=64, draft0=0.03, alphas={"code": 0.95})
    old_tps, old_ks, _ = _serve("adaptive", 200, ["code"], max_tokens=64, draft0=0.03, alphas={"code": 0.95},
                                old=True)
    assert max(fixed, key=fixed.get) == 4 and round(fixed[4] / fixed[0], 1) == 2.4
    assert ks == old_ks == {0: 1, 2: 1, 3: 2, 4: 196} and live.probes == 0
    assert round(tps / fixed[4], 2) == 0.99 and tps == pytest.approx(old_tps)


def test_measured_catch_ups_raise_the_catch_up_price():
    """A session 40 tokens behind whose first drafting step took 2.5 s, of which its own K = 2
    draft forwards are 2 x draft_s(8 sessions joined): the rest, per token behind, is the
    measured catch-up rate (EWMA 0.3), and the catch-up is priced at no less than it. A step
    less than 8 tokens behind, or at K = 0, is no sample."""
    c = BatchKController(budget=64)
    for p in (8, 64):
        c.observe_tick(8, p, 0.2 + 0.01 * p, [(8, 0.15)])
    live = BatchKSessions(c)
    for i in range(8):
        live.join(i, "code", "draft", k_range=(0, 4), prompt_tokens=40 if i == 0 else 4, max_tokens=24)
    model = c.cost.catchup_s(40)
    assert model == pytest.approx(40 * 0.84 / 64 * 0.15 / 0.28)
    live.observe_step(1, 2, 2, None, [], draft_s=9.0, verify_s=0.3)  # 4 behind: no sample
    live.observe_step(2, 0, 0, None, [], draft_s=0.0, verify_s=0.3)
    assert c.cost.snapshot()["catchup_s_per_token"] is None and c.cost.catchup_s(40) == model
    live.observe_step(0, 2, 2, None, [], draft_s=2.5, verify_s=0.3)
    rate = (2.5 - 2 * 0.15) / 40
    assert c.cost.snapshot()["catchup_s_per_token"] == pytest.approx(rate)
    assert c.cost.catchup_s(100) == pytest.approx(100 * rate) and 100 * rate > c.cost._catchup_model_s(100)
    c.cost.observe_catchup(10, 0.0)
    assert c.cost.catchup_s(100) == pytest.approx(100 * 0.7 * rate)
    with pytest.raises(ValueError, match="tokens >= 1"):
        c.cost.observe_catchup(0, 1.0)
