"""Start-up calibration of a draft replica's K-under-load cost model (before it reports ready).

A fresh draft replica's :class:`specdec.control.batch_cost.BatchCostModel` knows only its
priors: a 1-position verify at 0.05 s and a draft forward at a fifth of it. The first request's
first decisions were taken on them and on one or two thin measurements (served, w8a8 demo pair,
fresh server, one client on code: after one 3-position verify of 0.108 s a K = 0 step was priced
at 0.036 s where it measured 0.07-0.095 s, so K = 0 looked best; the request ran K 0-3 on 40 of
its 49 steps and 1.02x plain decoding, the second request, priced from measurements, K = 4 on 27
of 31 steps and 1.35x; docs/bench/served-w8a8/run-s9-default.txt). As vLLM profiles its forwards
at start-up, the replica here runs one generation on a fixed prompt through the very path its
requests take (its draft model and the draft combiner, the Target deployment's batched verify) at
the K its requests will run: a warm-up pass (each K once; a fresh process's first forward of a
shape is dearer while its kernels are created) and then ``repeats`` rounds of one step at
each K from ``k_max`` down to 0. The rounds interleave the K so that a few seconds of load from
another process land on every K's forwards alike: measured K after K (three steps of K = 4,
then three of K = 3, ..., K = 0 last), a burst of load in the first seconds priced only the
multi-position verifies high. Session 19 (2-core EPYC, w7a8 pair, served, one client):
calibrations that overlapped other processes' test runs or scripts priced 2-5 positions
1.3-1.6x their steady-state seconds (4 positions 0.23-0.26 s against 0.185 s) and 1 position,
measured last, right (0.17 s against 0.163 s); one replica then held its client at K = 0
(0.82x unbatched). On a quiet machine the same calibration priced 4 positions at 0.135-0.139 s
(0.152 s steady state; docs/bench/batching/served-s11/k-trace-s19-*.jsonl.gz, cal1 the quiet
one). The measured pass's verify forwards (1 to k_max + 1 positions, one row), draft forwards
(one row) and catch-up feed the cost model
(:meth:`specdec.control.batch_sessions.BatchKSessions.join` with ``calibration``), nothing else:
no acceptance estimate, goodput guard or tenant statistics see it. What it measured is a prior of
the shapes: a count's first forward measured in service replaces the calibration's samples, and a
tenant held at K = 0 by calibrated prices is probed at once on the service's own curve
(:class:`specdec.control.batch_cost.BatchCostModel`, "Calibration is a prior of the shapes").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

#: The calibration prompt (a code prompt, as the demo request): its text does not matter, only
#: that it is a few dozen tokens, as a chat request's prompt is.
CALIBRATION_TEXT = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, "
    "with a docstring and type hints, then a short test for it.\n"
)

#: Session id prefix of a calibration run on the target (closed when the run ends).
SESSION_PREFIX = "calibration-"


def calibration_schedule(k_max: int, repeats: int) -> list[tuple[str, int]]:
    """``(mode, K)`` per step of one calibration run: the warm-up pass (its first step prefills
    the prompt at ``k_max``, then each K from ``k_max`` down to 0 once), then ``repeats`` rounds
    of each K from ``k_max`` down to 0 (mode "measure"; interleaved: module docstring).

    Raises:
        ValueError: ``k_max < 0`` or ``repeats < 1``.
    """
    if k_max < 0 or repeats < 1:
        raise ValueError(f"need k_max >= 0 and repeats >= 1, got {k_max}, {repeats}")
    warm = [("warmup", k_max)] + [("warmup", k) for k in range(k_max, -1, -1)]
    return warm + [("measure", k) for _ in range(repeats) for k in range(k_max, -1, -1)]


def run_calibration(*, info: Any, draft_proposer: Any, batch_k: Any, combiner: Any,
                    send_factory: Callable[[str], Any], k_max: int, repeats: int,
                    clock: Callable[[], float] = time.perf_counter) -> dict:
    """Run one calibration generation (module docstring) and feed its measurements to ``batch_k``.

    Blocking (call it from a worker thread): every step is a draft combiner step whose verify is
    a remote call.

    Args:
        info: the target's facts (:class:`deployments.target_info.TargetInfo`: tokenizer,
            emittable vocabulary, context limit, EOS ids).
        draft_proposer: the replica's :class:`specdec.engine.proposers.draft_model.DraftModelProposer`.
        batch_k: the replica's :class:`specdec.control.batch_k.BatchKSessions`.
        combiner: the replica's :class:`specdec.engine.draft_combiner.DraftCombiner`.
        send_factory: ``routing key -> Send`` of the replica's target
            (:func:`deployments.remote_target.handle_send`; tests inject one).
        k_max: the largest K to calibrate (the replica's default request K).
        repeats: measured steps per K (>= 1).

    Returns:
        ``{"steps": steps run, "seconds": wall seconds, "cost": the cost model's snapshot after}``.

    Raises:
        ValueError: a bad ``k_max`` / ``repeats``; whatever a step raises (the caller logs it:
        serving does not depend on calibration).
    """
    from deployments.remote_target import RemoteTargetSession
    from specdec.engine.prompt import encode_prompt
    from specdec.engine.sessions import open_generation
    from specdec.request import GenerationRequest, SamplingParams, SpeculationParams

    schedule = calibration_schedule(k_max, repeats)
    t0 = clock()
    req = GenerationRequest(prompt=CALIBRATION_TEXT, max_tokens=(k_max + 1) * len(schedule) + 1, ignore_eos=True,
                            sampling=SamplingParams(temperature=0.0),
                            speculation=SpeculationParams(proposer="draft", k=max(k_max, 1)))
    prompt = encode_prompt(info.tokenizer, req, info.emittable_vocab)
    session_id = SESSION_PREFIX + _uid()
    send = send_factory(session_id)

    def open_target(history, sampling, seed, *, logprobs, processing, top_logprobs, prefix_scope):
        return RemoteTargetSession(session_id, history, sampling, seed, logprobs, send,
                                   processing=processing if processing.active else None, top_logprobs=top_logprobs,
                                   prefix_scope=prefix_scope)

    current = [schedule[0][1]]  # the K of the step about to run
    gen = open_generation(req, info, prompt, seed=0, draft_proposer=draft_proposer, open_target=open_target,
                          k=lambda: current[0])
    batch_k.join(gen, "", "draft", adaptive=False, k_range=(0, max(k_max, 1)), prompt_tokens=len(prompt),
                 calibration="warmup")
    steps = 0
    try:
        for mode, k in schedule:
            if gen.finished:
                break
            current[0] = k
            batch_k.set_calibration(gen, mode)
            combiner.step(gen)
            steps += 1
    finally:
        batch_k.leave(gen)
        combiner.leave(gen.proposer)
        gen.close()
    return {"steps": steps, "seconds": clock() - t0, "cost": batch_k.controller.cost.snapshot()}


class StartupCalibration:
    """A draft replica's start-up calibration, run once (:func:`run_calibration` in the replica's
    step executor); concurrent callers of :meth:`run` wait for the same run.

    Skipped (:meth:`run` returns None) without a draft model or K under load, with
    ``cfg.startup_calibration_repeats`` 0 or ``cfg.default_max_k`` 0. A run that fails is logged
    and not retried: requests are then priced from the priors, as before.

    Args:
        replica: the :class:`deployments.draft.Draft` (its cfg, info, draft_proposer, batch_k,
            combiner, step_executor, _send_factory and target_ready are used).
        start: start at once in the background, once the target answers (served: Serve runs the
            replica's constructor on its event loop; requests that come earlier run meanwhile).
    """

    def __init__(self, replica: Any, start: bool = False):
        self.replica = replica
        #: the run's result (None before it ended, when skipped, or when it failed)
        self.result: dict | None = None
        self._run: asyncio.Future | None = None
        self._task = None
        try:
            loop = asyncio.get_running_loop() if start else None
        except RuntimeError:  # no event loop (a replica built in a test)
            loop = None
        if loop is not None:
            self._task = loop.create_task(self._when_ready())

    async def settled(self) -> None:
        """Wait until the run started with the replica (``start``) has ended, failed, or been
        deferred (the target did not answer); at once when none was started."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _when_ready(self) -> None:
        try:
            await self.replica.target_ready()
        except Exception:  # the target not up: run() starts it when asked
            log.warning("start-up calibration deferred: the target did not answer", exc_info=True)
            return
        await self.run()
        from deployments.config import freeze_startup_objects_in_actor

        freeze_startup_objects_in_actor()  # what the calibration left alive (the first forwards' imports, state)

    async def run(self) -> dict | None:
        """Run the calibration (once) and return its result (None: skipped or failed)."""
        rep = self.replica
        if (rep.batch_k is None or rep.draft_proposer is None or rep.cfg.startup_calibration_repeats <= 0
                or rep.cfg.default_max_k <= 0):
            return None
        if self._run is None:
            self._run = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(rep.step_executor, self._blocking))
        try:
            self.result = await asyncio.shield(self._run)
        except Exception:
            log.exception("start-up calibration failed; K under load starts from the cost priors")
        return self.result

    def _blocking(self) -> dict:
        rep = self.replica
        out = run_calibration(info=rep.info, draft_proposer=rep.draft_proposer, batch_k=rep.batch_k,
                              combiner=rep.combiner, send_factory=rep._send_factory,
                              k_max=rep.cfg.default_max_k, repeats=rep.cfg.startup_calibration_repeats)
        log.info("start-up calibration: %d steps in %.1f s; cost model %s", out["steps"], out["seconds"], out["cost"])
        return out


def _uid() -> str:
    import uuid

    return uuid.uuid4().hex
