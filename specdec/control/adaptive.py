"""Glue between the K controller and a running generation: step timings, calibration.

- :func:`run_timed`: run a :class:`specdec.engine.decoder.Generation` step by step, collecting each
  step's K, draft and verify seconds (:class:`StepCosts`, the ``costs`` argument of
  :meth:`specdec.control.controller.KController.record`), time to first token and inter-token latency.
  The first step is left out of the costs: it carries the prompt prefill of both models.
- :func:`calibrate`: measure draft seconds per token and verify seconds for every number of
  positions 1..K_max+1 once (a few seconds of real speculation steps on a short prompt) and feed
  them to the controller, so that its first decisions use this machine's cost curve instead of
  priors. Costs keep being learned from real requests afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from specdec.request import SamplingParams
from specdec.types import DraftBlock, GenerationResult


@dataclass
class StepCosts:
    """Per-step timings of one request, aggregated by number of positions scored (K + 1) and by
    tokens drafted per block; the first step's draft seconds apart (the draft's prompt prefill
    plus that step's block: ``first_draft_s`` for ``first_drafted`` tokens; 0 and 0 when the
    first step did not draft). ``room_blocks``: drafted tokens -> blocks whose length was the
    room left in the request (``max_tokens`` - generated - 1: the engine shrank the K asked to
    it), the first step's included; such a block did not stop early, whatever its length."""

    verify: dict[int, list] = field(default_factory=dict)  # positions -> [seconds, steps]
    draft_s: float = 0.0
    drafted: int = 0
    skipped_steps: int = 0
    draft_blocks: dict[int, list] = field(default_factory=dict)  # drafted tokens -> [seconds, blocks]
    first_draft_s: float = 0.0
    first_drafted: int = 0
    room_blocks: dict[int, int] = field(default_factory=dict)

    def add(self, k: int, draft_s: float, verify_s: float, count_draft: bool = True) -> None:
        """One step of K = ``k``: its verify seconds by positions, and (``count_draft``) its
        draft seconds per drafted token."""
        v = self.verify.setdefault(k + 1, [0.0, 0])
        v[0] += verify_s
        v[1] += 1
        if k > 0 and count_draft:
            self.draft_s += draft_s
            self.drafted += k
            b = self.draft_blocks.setdefault(k, [0.0, 0])
            b[0] += draft_s
            b[1] += 1

    def as_dict(self) -> dict:
        return {
            "verify_s_by_positions": {p: [s, n] for p, (s, n) in sorted(self.verify.items())},
            "draft_s": self.draft_s,
            "drafted": self.drafted,
            "skipped_steps": self.skipped_steps,
            "draft_s_by_drafted": {d: [s, n] for d, (s, n) in sorted(self.draft_blocks.items())},
            "first_draft_s": self.first_draft_s,
            "first_drafted": self.first_drafted,
            "room_limited_blocks": dict(sorted(self.room_blocks.items())),
        }


class StepCostRecorder:
    """Turns a generation's cumulative stats into per-step :class:`StepCosts`.

    Call :meth:`after_step` after every ``Generation.step()``; a call that finds no new step does
    nothing. The first step (prompt prefill of both models) and any step the caller marks
    ``skip`` (e.g. a remote target session rebuilt from the token history) are counted in
    ``costs.skipped_steps`` only. A drafting step right after a K = 0 step counts its verify but
    not its draft seconds: the draft model did not run at K = 0, so that step's first draft
    forward also feeds every token decoded meanwhile (a prefill of up to a whole request's
    tokens), which is no cost per drafted token; charged to the one or two tokens drafted, it
    made drafting look several times dearer than it is and held a tenant at K = 0 (served demo
    pair in int4: 0.44 s per drafted token against 0.10 s for a one-position verify).

    Args:
        stats: the generation's live :class:`specdec.types.SpeculationStats`.
        max_tokens: the request's ``max_tokens``, or None: with it, a drafting step whose block
            is exactly the room left (``max_tokens`` - tokens generated before it - 1, the
            tokens counted as accepted + 1 per step) is counted in ``costs.room_blocks``.
    """

    def __init__(self, stats, max_tokens: int | None = None) -> None:
        self.stats = stats
        self.max_tokens = max_tokens
        self.costs = StepCosts()
        self._prev = self._snapshot()
        self._prev_k: int | None = None  # K of the last step seen (None: none yet)

    def _snapshot(self) -> tuple[int, int, float, float, int]:
        st = self.stats
        return st.steps, st.proposed, st.draft_time_s, st.verify_time_s, st.accepted

    def after_step(self, skip: bool = False) -> None:
        cur = self._snapshot()
        prev, self._prev = self._prev, cur
        if cur[0] == prev[0]:
            return
        k, prev_k = cur[1] - prev[1], self._prev_k
        if self.max_tokens is not None and k > 0 and cur[0] - prev[0] == 1:
            if k == self.max_tokens - (prev[0] + prev[4]) - 1:  # the engine cut the block to the room left
                self.costs.room_blocks[k] = self.costs.room_blocks.get(k, 0) + 1
        self._prev_k = k if cur[0] - prev[0] == 1 else None
        if prev[0] == 0 or skip or cur[0] - prev[0] != 1:
            self.costs.skipped_steps += cur[0] - prev[0]
            if prev[0] == 0 and not skip and cur[0] == 1:  # the first step: the draft's prefill + a block
                self.costs.first_draft_s, self.costs.first_drafted = cur[2] - prev[2], k
            return
        self.costs.add(k, cur[2] - prev[2], cur[3] - prev[3], count_draft=prev_k != 0)


@dataclass
class TimedRun:
    """A finished generation with its timings (seconds)."""

    result: GenerationResult
    costs: StepCosts
    wall_s: float
    ttft_s: float | None
    inter_token_s: float | None  # mean time between tokens after the first

    @property
    def tokens(self) -> int:
        return self.result.usage.completion_tokens


def run_timed(gen, clock: Callable[[], float] = time.perf_counter, started: float | None = None,
              max_tokens: int | None = None) -> TimedRun:
    """Run ``gen`` to the end step by step (see module docstring).

    Args:
        started: clock value when the request started (before ``engine.start``, so prompt
            encoding counts); defaults to now.
        max_tokens: the request's ``max_tokens`` (:class:`StepCostRecorder`: blocks cut to the
            room left are marked), or None.
    """
    t0 = clock() if started is None else started
    recorder = StepCostRecorder(gen.stats, max_tokens)
    costs = recorder.costs
    first_at = last_at = None
    n_tok = 0
    try:
        while True:
            chunk = gen.step()
            recorder.after_step()
            if chunk is not None:
                if chunk.token_ids:
                    now = clock()
                    if first_at is None:
                        first_at = now
                    last_at = now
                    n_tok += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    break
    finally:
        gen.close()
    end = clock()
    result = gen.result()
    itl = (last_at - first_at) / (n_tok - 1) if first_at is not None and n_tok > 1 else None
    return TimedRun(result, costs, end - t0, None if first_at is None else first_at - t0, itl)


def calibrate(
    engine,
    controller,
    *,
    proposer: str = "draft",
    max_k: int = 8,
    repeats: int = 3,
    prompt_ids: list[int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    blocks: bool = False,
) -> dict:
    """Measure real speculation steps at every K in 0..max_k and feed them to ``controller``.

    For each K runs one unrecorded step then ``repeats`` recorded steps (draft ``propose(K)``
    then target ``verify``) on one greedy sequence, after a warm-up step that absorbs both
    prefills, and calls
    ``controller.observe_step(proposer, K, draft_s, verify_s)`` once per K with the median
    times (robust to a step slowed by other load). Returns the cost model's snapshot.

    With ``blocks`` (the in-process bench, :mod:`benchmarks.inprocess_adaptive`): the medians
    are observed ``repeats`` times each (so that the one-position verify counts as measured for
    :meth:`KController.plain_bound`, which wants 3 observations) and the draft seconds also by
    block length (:meth:`CostModel.observe_draft_block`), so the cost model has every K's
    measured costs from the start and extrapolates none of them from the few K its requests
    ran (a taught controller on the demo pair held K = 2 on code at 32 tokens: only K <= 3 had
    been measured).
    """
    if engine.draft_proposer is None and proposer == "draft":
        raise ValueError("calibrating the draft proposer needs a draft model")
    if prompt_ids is None:
        prompt_ids = engine.target.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    sampling = SamplingParams()
    target = engine.verifier.open_session(prompt_ids, sampling, seed=0)
    draft = engine.draft_proposer.open_session(prompt_ids, sampling, seed=0) if proposer == "draft" else None
    max_k = min(max_k, controller.cost_model(proposer).max_positions - 1)
    try:
        def step(k: int) -> tuple[int, float, float]:
            t0 = clock()
            block = draft.propose(k) if (draft is not None and k > 0) else DraftBlock.empty()
            t1 = clock()
            res = target.verify(block)
            t2 = clock()
            if draft is not None:
                draft.commit(res.token_ids)
            return block.k, t1 - t0, t2 - t1

        step(1)  # prefill of both, not recorded
        samples: dict[int, list[tuple[float, float]]] = {}
        for k in range(0, max_k + 1):
            step(k)  # the first step after a change of K is not steady state (cache crop, draft catch-up)
            for _ in range(repeats):
                kk, d, v = step(k)
                samples.setdefault(kk, []).append((d, v))
        for kk, xs in sorted(samples.items()):  # the median per K: one slow step does not stick
            ds = sorted(x[0] for x in xs)
            vs = sorted(x[1] for x in xs)
            d_med, v_med = ds[len(ds) // 2], vs[len(vs) // 2]
            for _ in range(repeats if blocks else 1):
                controller.observe_step(proposer, kk, d_med, v_med)
                if blocks and kk > 0:
                    controller.cost_model(proposer).observe_draft_block(kk, d_med)
    finally:
        target.close()
        if draft is not None:
            draft.close()
    return controller.cost_model(proposer).snapshot()
