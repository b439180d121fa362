"""The Draft deployment: the decoding loop of each generation, and the draft model's KV caches.

Plain class (decorated in :mod:`deployments.app`). A draft replica holds the draft model (on a
fractional GPU from config, on CPU otherwise) and runs the core :class:`specdec.engine.decoder.Generation`
loop of every generation routed to it. The target side of the loop is a
:class:`deployments.remote_target.RemoteTargetSession`: each speculation step sends one
``CandidateBlock`` to the Target deployment, **one round trip per step** (that module holds the
transport, its wire statistics and the session rebuilding).

Proposers: ``draft`` (the draft model), ``ngram`` (prompt lookup) and ``none`` all run here, in
the draft replica: one code path owns every loop, the router stays out of the per-token path
and only relays the chunks this replica streams, and prompt lookup costs nothing to host here.

Rebuilding instead of failing (the target side rebuilds its lost sessions itself, see
:mod:`deployments.remote_target`): when this replica died mid-stream, the router resumes the generation on a (new) draft replica with
  a ``DraftJob`` carrying what the client already received and the checkpoint this replica
  reported with the last chunk the router got (a ``DraftChunkTrailer`` after each chunk's bytes:
  the tokens the step committed but the chunk held back, and the step count); the draft cache is
  rebuilt from that token history. Every step's randomness is seeded from (seed, the position
  the step starts from), and the history ends where a step ended, so the resumed generation
  produces the same output, token for token, also under seeded sampling.

Cancellation and deadlines: a cancelled stream (the client cancelled, or the router's request
was cancelled, or its deadline passed) stops between steps: a step in flight is told to the
target at once (``RemoteTargetSession.cancel``: the target drops what it has not computed of it,
e.g. the rest of a long prompt's chunked prefill), then the replica waits for that step and frees
both caches (draft here, target with a ``CloseSession``). The job's deadline is checked before
each step.

Interface (serialized protos, never pickled core objects):
``Generate(DraftJob bytes)`` streams ``GenerateStreamChunk`` bytes;
``Ready()``, ``Sessions()`` (ids of the generations running here; for tests and debugging),
``PrefixCacheStats()`` (the draft model's automatic prefix caching, :mod:`deployments.prefix_caching`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from deployments import convert
from deployments.aio import finish_despite_cancellation
from deployments.config import AppConfig, ray_assigned_cpus, torch_threads
# the target side; also importable from here, where it lived before
from deployments.remote_target import (  # noqa: F401
    MAX_REBUILDS_PER_STEP,
    TARGET_RESTART_BUDGET_S,
    VERIFY_TIMEOUT_S,
    RemoteTargetSession,
    Send,
    WireStats,
    handle_send,
    set_wire_stats,
)
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.control.adaptive import StepCostRecorder
from specdec.errors import DeadlineExceededError, InvalidRequestError
from specdec.types import GenerationChunk

log = logging.getLogger(__name__)


class Draft:
    """One draft replica: the draft model, and the generations (loops) running on it.

    Args:
        cfg: the application config.
        target: a Serve handle of the Target deployment.
        send_factory: ``(routing_key) -> Send``; tests inject one, default :func:`handle_send`.
        metrics: :class:`deployments.metrics.SpecDecMetrics` (default: Ray's metrics API).
        controller: the shared-state client the acceptance counts of K under load are pooled in
            (:meth:`deployments.controller_client.ControllerClient.for_app` by default: the shared
            actor of ``cfg.app_name`` and ``cfg.model_pair()``; pooled only when that is the shared actor, or when one is
            given).

    K under load (``cfg.served_batch_k``): :attr:`batch_k` (a
    :class:`specdec.control.batch_k.BatchKSessions`, next to the draft combiner) chooses the K of
    every step of a ``batch_adaptive`` job from the batch it runs in. It lives here, not in the
    shared controller actor, because K is needed before every step of every session: this
    replica sees its sessions' tenants, measures its own batched draft forwards, and gets the
    batched verify's rows, positions and seconds back in each verification result, while an
    actor call per step would put a round trip into every step.

    With several draft replicas each decides K for its own batch from its own measured costs,
    but acceptance is the tenant's: every ``cfg.batch_k_sync_s`` seconds (checked after a step)
    and when a generation ends the replica sends the steps it recorded to its application's
    shared controller actor and takes back the counts pooled over all draft replicas of the
    application, no other's (:meth:`SyncBatchK`; the pooling is described in
    :mod:`deployments.controller_actor`).
    """

    def __init__(self, cfg: AppConfig, target: Any = None, send_factory: Callable[[str], Send] | None = None,
                 metrics: Any = None, controller: Any = None):
        import torch

        from deployments.target_info import TargetInfo

        assigned = ray_assigned_cpus()
        torch.set_num_threads(torch_threads(cfg.draft_cpu_threads or cfg.cpu_threads,
                                            cfg.draft_num_cpus if assigned is None else assigned))
        #: runs the generations' blocking work (open, steps, close): one thread per request
        #: this replica may run at once (Serve's max_ongoing_requests), never the host's count
        self.step_executor = ThreadPoolExecutor(max_workers=cfg.draft.max_ongoing_requests,
                                                thread_name_prefix="specdec-step")
        self.cfg = cfg
        self.target = target
        self._send_factory = send_factory or (lambda key: handle_send(self.target, key))
        self.info = TargetInfo.load(cfg.target_model, cfg.target_format())
        self.draft_proposer = None
        if cfg.draft_model:
            from specdec.models.loaded import TokenizerFacts
            from specdec.models.loader import load_model, resolve_folder
            from specdec.models.release import release_freed_memory
            from specdec.models.spec import parse_model_spec
            from specdec.models.vocab import VocabSide, check_vocab_compatible, same_tokenizer_files
            from specdec.engine.proposers.draft_model import DraftModelProposer

            from deployments.tp_worker import worker_device

            # the GPU Ray gave this replica (cuda:0 in its view); a clear error, not a silent CPU
            # run, when it holds one but this torch cannot use it
            device = worker_device(cfg.draft_num_gpus)
            fmt = cfg.draft_format(device.type)
            # one tokenizer in this replica (~150 MiB each for the demo pair's): the target's (self.info,
            # for text) also serves as the draft's when their files are the same
            shared = same_tokenizer_files(resolve_folder(cfg.draft_model, fmt),
                                          resolve_folder(cfg.target_model, cfg.target_format()))
            draft = load_model(parse_model_spec(cfg.draft_model), device=device, weight_format=fmt,
                               vocab_subset=cfg.draft_vocab_subset, vocab_table=cfg.draft_vocab_table,
                               tokenizer=self.info.tokenizer if shared else None)
            check_vocab_compatible(VocabSide.of(draft), self.info.vocab_side())
            if not shared:  # checked against the target's: the draft keeps its tokenizer's facts only
                draft.tokenizer = TokenizerFacts.of(draft.tokenizer)
                release_freed_memory()
            self.draft_proposer = DraftModelProposer(draft, eos_ids=self.info.eos_token_ids)
            from deployments.prefix_caching import serve_prefix_cache

            # with draft_batching every draft forward runs in the combiner's one drafting thread;
            # without, sessions feed from their own threads: copy only from closed sessions then
            serve_prefix_cache(draft, cfg.prefix_cache_entries, "draft", live=cfg.draft_batching)
        #: generation id -> its Generation (the sessions whose draft caches live here)
        self.sessions: dict[str, Any] = {}
        self._gauged: dict[str, float] = {}  # tenant -> when its batch-K gauges were last set
        self._lock = threading.Lock()
        from deployments.metrics import SpecDecMetrics
        from specdec.control.batch_k import BatchKController, BatchKSessions, GoodputGuard
        from specdec.engine.draft_combiner import DraftCombiner

        self.metrics = metrics if metrics is not None else SpecDecMetrics()
        #: K under load per tenant (None: the router's K holds for every step)
        # the estimator's defaults (GLOBAL_PRIOR_WEIGHT) are the in-process controller's too
        self.batch_k = (BatchKSessions(BatchKController(budget=cfg.max_batch_positions),
                                      trace=os.environ.get("SPECDEC_BATCH_K_TRACE") or None,
                                      guard=GoodputGuard() if cfg.batch_k_goodput_guard else None)
                        if cfg.served_batch_k else None)
        #: where the batch controller's acceptance counts are pooled with the other replicas'
        self.shared = None
        if self.batch_k is not None and cfg.batch_k_sync_s > 0:
            if controller is None:
                from deployments.controller_client import ControllerClient

                controller = ControllerClient.for_app(cfg)  # this application and pair's actor, no other's
                controller = controller if controller.is_shared else None  # alone: nothing to pool
            self.shared = controller
        self.replica_id = uuid.uuid4().hex
        self._synced_at = time.monotonic()
        self._sync_task: asyncio.Task | None = None
        self._sync_again = False
        #: batches the drafting of the generations stepped concurrently (continuous batching)
        self.combiner = DraftCombiner(batched=cfg.draft_batching, window_s=cfg.batch_window_s,
                                      max_prefill=cfg.draft_prefill_chunk, k_control=self.batch_k,
                                      peers=lambda: len(self.sessions))
        from deployments.draft_calibration import StartupCalibration

        #: the start-up calibration of K under load (:meth:`calibrate`); served, it starts in
        #: the background once the target answers
        self.startup = StartupCalibration(self, start=target is not None)
        from deployments.config import freeze_startup_objects_in_actor

        freeze_startup_objects_in_actor()  # models loaded (calibration still to run): out of full collections

    # --- building one generation -------------------------------------------------------------

    def _start(self, job: xpb.DraftJob):
        """Open the proposer and remote target sessions of ``job``; returns (Generation, target)."""
        from specdec.control.controller import k_schedule
        from specdec.engine.sessions import open_generation

        req = convert.request_from_proto(job.request)
        prompt = list(req.prompt_token_ids or [])
        if not prompt:
            raise InvalidRequestError("the draft replica needs a tokenized prompt")
        seed = req.sampling.seed if req.sampling.seed is not None else 0
        resume = convert.checkpoint_from_job(job, seed)
        probe = job.probe_steps or None  # a probe's schedule continues after the steps already run
        if probe is not None and resume is not None:
            probe = max(0, probe - resume.steps)
        send = self._send_factory(job.session_id)

        def open_target(history, sampling, seed, *, logprobs, processing, top_logprobs, prefix_scope):
            target = RemoteTargetSession(
                job.session_id, history, sampling, seed, logprobs, send,
                processing=processing if processing.active else None, top_logprobs=top_logprobs,
                prefix_scope=prefix_scope,
            )
            target.tenant, target.tenant_weight = job.tenant, (job.tenant_weight or 1.0)
            return target

        tenant = job.tenant or "default"
        adaptive = bool(job.batch_adaptive) and self.batch_k is not None and req.speculation.k > 0
        if adaptive:
            k = self.batch_k.schedule(tenant, req.speculation.k, min(job.k_min, req.speculation.k), probe or 0)
        else:
            k = k_schedule(req.speculation.k, probe)
        gen = open_generation(
            req, self.info, prompt, seed=seed, draft_proposer=self.draft_proposer, open_target=open_target,
            k=k, resume=resume, prefix_tenant=tenant if self.cfg.prefix_cache_scope == "tenant" else "",
        )
        if self.batch_k is not None:
            self.batch_k.join(gen, tenant, req.speculation.proposer if req.speculation.k > 0 else "none",
                              adaptive=adaptive, weight=job.tenant_weight or 1.0,
                              k_range=(min(job.k_min, req.speculation.k), req.speculation.k),
                              prompt_tokens=len(prompt) if resume is None else 0, max_tokens=req.max_tokens,
                              context_tokens=len(prompt) + (len(resume.token_ids) if resume is not None else 0))
        return gen, gen.target

    # --- the streaming method ----------------------------------------------------------------

    async def Generate(self, job_bytes: bytes):
        """Run one generation; stream serialized ``GenerateStreamChunk`` messages.

        The last chunk carries finish reason, usage and stats (with the wire numbers).

        Raises:
            InvalidRequestError, PromptTooLongError: a bad job (before anything is streamed).
            DeadlineExceededError: the job's deadline passed.
            ModelNotReadyError: the target could not be reached or rebuilt.
        """
        job = xpb.DraftJob.FromString(job_bytes)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        start = loop.run_in_executor(self.step_executor, self._start, job)
        try:
            gen, target = await asyncio.shield(start)
        except asyncio.CancelledError:  # cancelled while opening: free what _start builds
            start.add_done_callback(_close_started)
            raise
        sid = job.session_id
        with self._lock:
            self.sessions[sid] = gen
        costs = StepCostRecorder(gen.stats)
        rebuilds = target.wire.rebuilds
        fut = None
        try:
            while True:
                if job.deadline_unix_s and time.time() > job.deadline_unix_s:
                    raise DeadlineExceededError("the request's deadline passed during generation")
                fut = loop.run_in_executor(self.step_executor, self.combiner.step, gen)
                chunk = await asyncio.shield(fut)
                fut = None
                costs.after_step(skip=target.wire.rebuilds != rebuilds)  # a rebuild re-ran the prefill
                rebuilds = target.wire.rebuilds
                self._record_batch_k(job)
                self._maybe_sync_batch_k()
                if chunk is None:
                    if not gen.finished:
                        continue
                    # finished without a chunk left (a resume whose history already ended)
                    chunk = GenerationChunk("", [], [] if gen.assembler.want_logprobs else None,
                                            gen.assembler.finish_reason)
                text = chunk.text
                last = chunk.finish_reason is not None
                msg = pb.GenerateStreamChunk(text=text, token_ids=chunk.token_ids, logprobs=chunk.logprobs or [],
                                             top_logprobs=convert.top_logprobs_to_proto(chunk.top_logprobs))
                if last:
                    res = gen.result()
                    msg = convert.chunk_to_proto(chunk, res.usage, res.stats, time.perf_counter() - t0)
                    msg.text = text
                    set_wire_stats(msg.stats, target.wire)
                    convert.set_step_costs(msg.stats, costs.costs.as_dict())
                if last:
                    yield msg.SerializeToString()
                elif msg.text or msg.token_ids:  # with the checkpoint of this step's end (a resume point)
                    yield msg.SerializeToString() + convert.checkpoint_trailer(gen.checkpoint()).SerializeToString()
                if last:
                    return
        finally:
            await finish_despite_cancellation(self._end(loop, sid, gen, fut))

    async def _end(self, loop: asyncio.AbstractEventLoop, sid: str, gen: Any, fut: Any) -> None:
        """Let the step in flight end, free both caches (draft here, target by CloseSession)."""
        try:
            if fut is not None and not fut.done():  # cancelled mid-step
                # tell the target first: it drops what it has not computed yet of the step (the
                # rest of a long prompt's prefill), so the step in flight ends soon
                cancel = getattr(getattr(gen, "target", None), "cancel", None)
                if cancel is not None:
                    await loop.run_in_executor(None, cancel)
                await asyncio.wait([fut])
                if not fut.cancelled():
                    fut.exception()  # retrieved: a step ended by the cancellation is no error
            await loop.run_in_executor(self.step_executor, gen.close)
        finally:
            # drafting batches stop waiting for it (a cancelled or failed step never reached
            # the combiner's own leave: its batches lingered for it until it was collected)
            self.combiner.leave(gen.proposer)
            if self.batch_k is not None:
                self.batch_k.leave(gen)
                self._maybe_sync_batch_k(force=True)
            with self._lock:
                self.sessions.pop(sid, None)
            try:
                self._record_prefix_cache()
            except Exception:  # metrics never break serving
                log.exception("metrics")

    def _record_prefix_cache(self) -> dict:
        """Count the draft's prefix cache hits since the last call (``specdec_prefix_cache_*``)."""
        from deployments.prefix_caching import prefix_stats

        if self.draft_proposer is None:
            return prefix_stats(None)
        stats = prefix_stats(self.draft_proposer.draft.model)
        self.metrics.record_prefix_cache("draft", stats)
        return stats

    async def PrefixCacheStats(self) -> dict:
        """The draft model's prefix cache (``AppConfig.prefix_cache_entries``):
        ``{"enabled", "entries", "held", "hits", "shared_positions"}``
        (:func:`deployments.prefix_caching.prefix_stats`; all 0 without a draft model). The
        ``specdec_prefix_cache_*`` counters are brought up to date (as every generation's end does)."""
        return self._record_prefix_cache()

    def _record_batch_k(self, job: xpb.DraftJob) -> None:
        """Set the tenant's K-under-load gauges (at most once a second per tenant)."""
        if self.batch_k is None:
            return
        tenant = job.tenant or "default"
        now = time.monotonic()
        if now - self._gauged.get(tenant, -1e9) < 1.0:
            return
        self._gauged[tenant] = now
        try:
            proposer = convert.PROPOSER_FROM_PROTO.get(job.request.speculation.proposer, "draft")
            alpha = self.batch_k.alpha(tenant, proposer) if job.batch_adaptive and proposer != "none" else None
            self.metrics.record_batch_k(tenant, proposer, self.batch_k.tenant_stats(tenant), acceptance_rate=alpha)
        except Exception:  # metrics never break serving
            log.exception("metrics")

    def _maybe_sync_batch_k(self, force: bool = False) -> None:
        """Start a :meth:`SyncBatchK` in the background when ``batch_k_sync_s`` passed since the
        last one (after a step), or at once (``force``: a generation ended, so that its last
        steps reach the pool); one runs at a time, a forced one during it runs right after."""
        if self.shared is None:
            return
        if self._sync_task is not None and not self._sync_task.done():
            self._sync_again = self._sync_again or force
            return
        now = time.monotonic()
        if not force and now - self._synced_at < self.cfg.batch_k_sync_s:
            return
        self._synced_at = now
        self._sync_task = asyncio.get_running_loop().create_task(self._sync_quietly())

    async def _sync_quietly(self) -> None:
        while True:
            self._sync_again = False
            try:
                await self.SyncBatchK()
            except Exception:  # an exchange never breaks serving
                log.exception("acceptance exchange failed")
            if not self._sync_again:
                return
            self._synced_at = time.monotonic()

    async def SyncBatchK(self) -> dict:
        """Pool this replica's acceptance counts with the other draft replicas' now: send the
        steps recorded since the last exchange to the application's shared controller actor, take back the
        pooled counts and replay onto them the steps recorded meanwhile
        (:meth:`specdec.control.batch_k.BatchKSessions.merge_pooled`).

        Returns:
            ``{"sent": steps sent, "taken": [[tenant, proposer], ...] keys taken from the pool}``;
            ``{"sent": 0, "taken": [], "error": message}`` when the actor could not be reached
            (the steps go with the next exchange; the replica keeps its own counts meanwhile).
        """
        if self.shared is None:
            return {"sent": 0, "taken": []}
        report = self.batch_k.take_sync_report()
        sent = sum(int(e[4]) for seg in report["segments"] for e in seg["steps"])
        try:
            pooled = await self.shared.sync_batch_acceptance(self.replica_id, report)
            taken = self.batch_k.merge_pooled(pooled, report)
        except Exception as e:  # the actor away or restarting: learn alone meanwhile
            self.batch_k.restore_report(report)
            log.warning("could not pool acceptance counts with the controller actor (%s: %s)", type(e).__name__, e)
            return {"sent": 0, "taken": [], "error": f"{type(e).__name__}: {e}"}
        return {"sent": sent, "taken": [list(k) for k in taken]}

    async def BatchKStats(self, tenant: str) -> dict:
        """K under load for ``tenant`` on this replica: its
        :meth:`BatchKSessions.tenant_view` (``{"k_under_load", "k_model", "decided_at",
        "guard_forced", "rows_per_step", "positions_per_step", "steps", "sessions"}``) plus
        ``"replica"``: this replica's id; ``{}`` when ``served_batch_k`` is off."""
        return {} if self.batch_k is None else dict(self.batch_k.tenant_view(tenant), replica=self.replica_id)

    # --- readiness and debugging -------------------------------------------------------------

    async def target_ready(self) -> bool:
        """True once the target deployment answers (what the start-up calibration waits for)."""
        if self.target is not None:
            await self.target.Ready.remote()
        return True

    async def Ready(self) -> bool:
        """True once this replica's model is loaded and the target deployment answers (requests
        are served from then on, also while the start-up calibration runs)."""
        return await self.target_ready()

    async def Settled(self) -> bool:
        """:meth:`Ready`, and the start-up calibration started with the replica (served) has
        ended or failed: what the router's ``GET /health`` waits for, so that a Kubernetes
        readiness probe sends no traffic into calibration. Before, /health answered 200 after
        16 s while calibration ran until 111.7 s, and a first 32-token request took 64.8 s behind
        it (user12, session 12, the default preset on a 2-core AVX2 CPU)."""
        await self.target_ready()
        await self.startup.settled()
        return True

    async def calibrate(self) -> dict | None:
        """The start-up calibration's result (:class:`deployments.draft_calibration.StartupCalibration`:
        run once, concurrent callers wait for the same run; None when it does not run or failed).
        `specdec serve` waits for it before it reports ready."""
        return await self.startup.run()

    def Sessions(self) -> list[str]:
        """Ids of the generations running on this replica (their draft caches are held here)."""
        with self._lock:
            return sorted(self.sessions)


def _close_started(start: "asyncio.Future") -> None:
    """Done-callback of a ``_start`` whose caller was cancelled: close the unused Generation."""
    if start.cancelled() or start.exception() is not None:
        return
    gen = start.result()[0]
    threading.Thread(target=gen.close, name="specdec-close-unused", daemon=True).start()
