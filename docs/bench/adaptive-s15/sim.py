"""Replay the in-process adaptive controller (``benchmarks.inprocess_adaptive``) on a simulated
engine: no models, seconds from a cost table, acceptance from a per-text-position table.

``PYTHONPATH=$PWD python docs/bench/adaptive-s15/sim.py`` prints, for 32 and 128 new tokens, the
steps at K, tokens per step and the simulated speedup over plain decoding of fixed K = 3/8/12
and of the controller cold (a fresh one) and taught by 4 warm requests, on a "code" text whose
draft is wrong at a few positions (all drafts confident: the demo pair on code-prime, session
14, never stopped a block early at 32 tokens) and on a "creative" text (half the drafts wrong,
most unsure). The costs are session 14's Zen 4 w8a8 pair (docs/bench/formats/bench-s14/:
target step ~0.177 s, verify of 5/9/13 positions ~0.19/0.237/0.262 s, a draft block of d
tokens ~0.085 + 0.06 (d - 1) s, prefills ~0.3 s target, ~0.2 s draft). It drives the real
controller, goodput guard and step-cost recorder; only the engine is fake.
"""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass

from specdec.types import GenerationChunk, GenerationResult, SpeculationStats, Usage

VERIFY = {1: 0.177, 5: 0.19, 9: 0.237, 13: 0.262}
DRAFT_FIRST, DRAFT_LATER, DRAFT_CATCHUP = 0.085, 0.06, 0.02
TARGET_PREFILL, DRAFT_PREFILL = 0.3, 0.2


def verify_s(p: int) -> float:
    pts = sorted(VERIFY.items())
    for (p1, t1), (p2, t2) in zip(pts, pts[1:]):
        if p1 <= p <= p2:
            return t1 + (t2 - t1) * (p - p1) / (p2 - p1)
    return pts[-1][1] + (p - pts[-1][0]) * 0.006


@dataclass
class Text:
    """Per position of the output: is the draft's token right, is the draft sure of it."""

    correct: list[bool]
    confident: list[bool]


def code_text(n: int, wrong: set[int]) -> Text:
    return Text([i not in wrong for i in range(n)], [True] * n)


def random_text(n: int, seed: int, p_wrong: float, p_again: float, p_unsure_wrong: float, p_unsure_right: float) -> Text:
    rng = random.Random(seed)
    correct, conf, prev_wrong = [], [], False
    for _ in range(n):
        w = rng.random() < (p_again if prev_wrong else p_wrong)
        correct.append(not w)
        conf.append(not (rng.random() < (p_unsure_wrong if w else p_unsure_right)))
        prev_wrong = w
    return Text(correct, conf)


class FakeGen:
    """What :func:`specdec.control.adaptive.run_timed` needs of a Generation."""

    def __init__(self, text: Text, max_tokens: int, k, speculate: bool):
        self.text, self.max_tokens, self.k, self.speculate = text, max_tokens, k, speculate
        self.stats = SpeculationStats()
        self.t = 0
        self.prev_k = None

    def step(self):
        if self.t >= self.max_tokens:
            return GenerationChunk(text="", token_ids=[], finish_reason="length")
        want = (int(self.k()) if callable(self.k) else int(self.k)) if self.speculate else 0
        k = max(0, min(want, self.max_tokens - self.t - 1))
        d = 0
        while d < k:
            d += 1
            if not self.text.confident[self.t + d - 1]:
                break
        a = 0
        while a < d and self.text.correct[self.t + a]:
            a += 1
        draft = 0.0
        if d:
            draft = DRAFT_FIRST + DRAFT_LATER * (d - 1)
            if self.stats.steps == 0:
                draft += DRAFT_PREFILL
            elif self.prev_k == 0:
                draft += DRAFT_CATCHUP * 4
        verify = verify_s(d + 1) + (TARGET_PREFILL if self.stats.steps == 0 else 0.0)
        self.stats.record_step(d, a, draft, verify)
        self.prev_k = d
        n = min(a + 1, self.max_tokens - self.t)
        self.t += n
        fin = "length" if self.t >= self.max_tokens else None
        return GenerationChunk(text="", token_ids=[0] * n, finish_reason=fin)

    def close(self):
        pass

    def result(self):
        return GenerationResult(text="", token_ids=[0] * self.t, finish_reason="length",
                                usage=Usage(0, self.t), stats=self.stats)


class FakeEngine:
    def __init__(self, texts: dict):
        self.texts = texts
        self.current = None

    def start(self, req, k=None):
        spec = req.speculation
        return FakeGen(self.current, req.max_tokens, spec.k if k is None else k, spec.k > 0)


def seconds(stats) -> float:
    return stats.draft_time_s + stats.verify_time_s


def plain_s(n: int) -> float:
    return TARGET_PREFILL + n * verify_s(1)


def run_fixed(text: Text, n: int, k: int):
    g = FakeGen(text, n, k, k > 0)
    while g.step().finish_reason is None:
        pass
    return g.stats


def run_ctl(engine, ctl, tenant, text, n):
    from benchmarks import inprocess_adaptive as ia

    engine.current = text
    timed, d = ia.run_adaptive(engine, ctl, tenant, [1, 2, 3], n, 0.4)
    return timed, d


def calibrated() -> dict:
    """What :func:`benchmarks.inprocess_adaptive.calibrated_costs` measures, from the cost table."""
    from benchmarks import inprocess_adaptive as ia

    ctl = ia.new_controller()
    cm = ctl.cost_model("draft")
    for k in range(0, ia.POLICY["k_max"] + 1):
        d = DRAFT_FIRST + DRAFT_LATER * (k - 1) if k else 0.0
        for _ in range(3):
            ctl.observe_step("draft", k, d, verify_s(k + 1))
            if k:
                cm.observe_draft_block(k, d)
    return cm.export_observations()


def main(argv=None) -> int:
    from benchmarks import inprocess_adaptive as ia

    calibrate = "--no-calibration" not in (argv if argv is not None else sys.argv[1:])
    costs = calibrated() if calibrate else None

    code = code_text(256, {10, 21, 40, 41, 55, 70, 86, 87, 100, 118})
    warm_code = [random_text(256, s, 0.08, 0.4, 0.5, 0.02) for s in range(4)]
    creative = random_text(256, 99, 0.5, 0.5, 0.7, 0.4)
    warm_creative = [random_text(256, 100 + s, 0.5, 0.5, 0.7, 0.4) for s in range(4)]
    engine = FakeEngine({})
    for n in (32, 128):
        for name, text, warm in (("code", code, warm_code), ("creative", creative, warm_creative)):
            base = plain_s(n)
            for k in (3, 8, 12):
                st = run_fixed(text, n, k)
                print(f"{n:4d} {name:9s} K={k:<2d}      {base / seconds(st):.2f}x steps {dict(sorted(st.k_counts.items()))}")
            for w in (0, 4):
                ctl = ia.new_controller(costs)
                for i in range(w):
                    timed, d = run_ctl(engine, ctl, name, warm[i], n)
                    ia.record(ctl, name, timed)
                timed, d = run_ctl(engine, ctl, name, text, n)
                st = timed.result.stats
                print(f"{n:4d} {name:9s} adaptive-w{w} {base / seconds(st):.2f}x steps {dict(sorted(st.k_counts.items()))}"
                      f" decided K={d.k} ({d.reason}, alpha {d.alpha:.3f}, best {d.best_k})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
