"""benchmarks/k_prediction.py: the controller's prediction against measured steps (exact on
hand-made steps; real runs on the tiny pair identical to K = 0)."""

from __future__ import annotations

import pytest

from benchmarks.k_prediction import compare, cost_model_from, format_table, measure


def _run(k, rep, steps, tokens, cpu):
    return {"k": k, "repeat": rep, "steps": steps, "token_ids": list(range(tokens)), "cpu_s": cpu}


def test_compare_prices_steps_like_the_controller_and_pairs_with_k0():
    # K = 0: prefill step then 1 s plain steps; K = 2: 0.3 s per draft token, 1.2 s verify of 3
    plain = [[0, 0, 0.0, 2.0, 2.0]] + [[0, 0, 0.0, 1.0, 1.0]] * 4
    spec = [[2, 2, 0.6, 3.0, 3.6], [2, 2, 0.6, 1.2, 1.8], [2, 1, 0.6, 1.2, 1.8], [2, 0, 0.6, 1.2, 1.8]]
    runs = [_run(0, 0, plain, 5, 6.0), _run(2, 0, spec, 7, 9.0)]
    cm = cost_model_from(runs)
    assert cm.verify_s(1) == pytest.approx(1.0) and cm.verify_s(3) == pytest.approx(1.2)
    assert cm.draft_s_per_token == pytest.approx(0.3)
    (row,) = compare(runs)
    alpha = 3 / (3 + 2)  # steps 2..: accepted 2 + 1 + 0, two steps with a rejection
    e = 1 + alpha + alpha ** 2
    assert row["k"] == 2 and row["alpha"] == pytest.approx(alpha)
    assert row["model_tokens_per_step"] == pytest.approx(e)
    assert row["model_step_s"] == pytest.approx(1.8)
    assert row["predicted"] == pytest.approx(e / 1.8)
    assert row["tokens_per_step"] == pytest.approx(6 / 3) and row["step_s"] == pytest.approx(1.8)
    assert row["steady"] == pytest.approx((6 / 5.4) / (4 / 4.0))
    assert row["request"] == pytest.approx((7 / 9.0) / (5 / 6.0))
    assert row["identical"] is False  # 7 tokens against K = 0's 5
    assert "| 2 | 0.60 |" in format_table("p", runs)


def test_compare_needs_k0_in_every_repeat():
    with pytest.raises(ValueError, match="no K = 0 run in repeat 1"):
        compare([_run(0, 0, [[0, 0, 0, 1, 1]] * 2, 2, 2.0), _run(2, 1, [[2, 2, 0.1, 1, 1]] * 2, 2, 2.0)])


def test_measure_on_the_tiny_pair_matches_k0(tiny_target, tiny_draft_close):
    from specdec.engine.engine import SpeculativeEngine

    engine = SpeculativeEngine(tiny_target, tiny_draft_close)
    runs = measure(engine, [5, 17, 42, 99, 7], [0, 2, 4], 0.0, 12, 2)
    assert [(r["k"], r["repeat"]) for r in runs] == [(0, 0), (2, 0), (4, 0), (4, 1), (2, 1), (0, 1)]
    assert all(len(r["token_ids"]) == 12 and sum(s[1] + 1 for s in r["steps"]) == 12 for r in runs)
    rows = compare(runs)
    assert [r["k"] for r in rows] == [2, 4] and all(r["identical"] for r in rows)
