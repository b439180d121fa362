"""The Draft deployment: the decoding loop of each generation, and the draft model's KV caches.

Plain class (decorated in :mod:`deployments.app`). A draft replica holds the draft model (on a
fractional GPU from config, on CPU otherwise) and runs the core :class:`specdec.engine.decoder.Generation`
loop of every generation routed to it. The target side of the loop is a
:class:`RemoteTargetSession`: each speculation step serializes one ``CandidateBlock`` proto and
sends it to the Target deployment through a Serve handle with ``.options(session_id=...)``
(ConsistentHashRouter keeps the session on one target replica): **one round trip per step**.

Proposers: ``draft`` (the draft model), ``ngram`` (prompt lookup) and ``none`` all run here, in
the draft replica: one code path owns every loop, the router stays out of the per-token path
and only relays the chunks this replica streams, and prompt lookup costs nothing to host here.

Rebuilding instead of failing:

- the target replica lost the session (restarted, or the session moved after scaling): it
  answers SESSION_MISSING / POSITION_MISMATCH and the block is resent with ``open`` built from
  the full token history;
- this replica died mid-stream: the router resumes the generation on a (new) draft replica with
  a ``DraftJob`` carrying what the client already received and the checkpoint this replica
  reported with the last chunk the router got (a ``DraftChunkTrailer`` after each chunk's bytes:
  the tokens the step committed but the chunk held back, and the step count); the draft cache is
  rebuilt from that token history. Every step's randomness is seeded from (seed, the position
  the step starts from), and the history ends where a step ended, so the resumed generation
  produces the same output, token for token, also under seeded sampling.

Cancellation and deadlines: a cancelled stream (the client cancelled, or the router's request
was cancelled) stops between steps, waits for the step in flight, and frees both caches (draft
here, target with a ``CloseSession``). The job's deadline is checked before each step.

Interface (serialized protos, never pickled core objects):
``Generate(DraftJob bytes)`` streams ``GenerateStreamChunk`` bytes;
``Ready()``, ``Sessions()`` (ids of the generations running here; for tests and debugging).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from deployments import convert
from deployments.aio import finish_despite_cancellation
from specdec.control.adaptive import StepCostRecorder
from deployments.config import AppConfig, ray_assigned_cpus, torch_threads
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import (
    DeadlineExceededError,
    GenerationCancelledError,
    InvalidRequestError,
    ModelNotReadyError,
)
from specdec.types import DraftBlock, GenerationChunk, VerifyResult

log = logging.getLogger(__name__)

#: Times one block is resent with ``open`` after SESSION_MISSING / POSITION_MISMATCH.
MAX_REBUILDS_PER_STEP = 2
#: Seconds one Verify / CloseSession call may take before the step fails.
VERIFY_TIMEOUT_S = 300.0
#: Seconds a step keeps retrying while the target replica is dead/restarting (it then rebuilds).
TARGET_RESTART_BUDGET_S = 180.0

#: ``send(method, payload) -> reply``: one call to the target (``Verify`` or ``CloseSession``).
Send = Callable[[str, bytes], bytes]


@dataclass
class WireStats:
    """Draft <-> target traffic of one generation."""

    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trip_s: float = 0.0
    target_time_s: float = 0.0
    rebuilds: int = 0
    max_block_bytes: int = 0
    per_step_bytes: list[int] = field(default_factory=list)

    @property
    def bytes_per_step(self) -> float:
        return (self.bytes_sent + self.bytes_received) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_per_step": self.bytes_per_step,
            "max_block_bytes": self.max_block_bytes,
            "round_trip_s_mean": self.round_trip_s / n,
            "target_time_s_mean": self.target_time_s / n,
            "transport_s_mean": (self.round_trip_s - self.target_time_s) / n,
            "rebuilds": self.rebuilds,
        }


class RemoteTargetSession:
    """A target session on a remote target replica; a :class:`specdec.engine.decoder.TargetLike`.

    Args:
        session_id: the key of the session in the target's session table (unique per generation).
        history: the committed sequence so far (the prompt, or prompt + tokens already emitted).
        sampling: the request's sampling parameters.
        seed: the target side's seed (``specdec.engine.sampling.derive_seeds(seed)[1]``).
        logprobs: whether the target returns log-probabilities.
        send: the transport, ``send("Verify" | "CloseSession", payload) -> reply``.
        clock: seconds clock (tests inject one).
        processing: the request's output-dependent logit processing (sent with ``open``).
        top_logprobs: with logprobs, the N most likely tokens per emitted token (0: none).
    """

    def __init__(self, session_id: str, history, sampling, seed: int, logprobs: bool, send: Send,
                 clock: Callable[[], float] = time.perf_counter, processing: Any = None, top_logprobs: int = 0):
        self.session_id = session_id
        self._history = [int(t) for t in history]
        self.sampling = sampling
        self.seed = seed
        self.want_logprobs = logprobs
        self.processing = processing
        self.top_logprobs = top_logprobs
        self._send = send
        self._clock = clock
        self._needs_open = True
        self._sent = False  # a Verify went out: the target may hold this session
        self.closed = False
        self.wire = WireStats()
        #: tenant and batch weight sent with ``open`` (fair order of the target's batched forwards)
        self.tenant, self.tenant_weight = "", 1.0

    @property
    def committed_len(self) -> int:
        return len(self._history)

    @property
    def token_ids(self) -> list[int]:
        return self._history

    def _open_msg(self) -> xpb.SessionOpen:
        msg = convert.session_open_to_proto(self._history, self.sampling, self.seed, self.want_logprobs,
                                            self.processing, self.top_logprobs)
        msg.tenant, msg.tenant_weight = self.tenant, self.tenant_weight
        return msg

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Send one block, get its verification (rebuilding the remote session when asked).

        Raises:
            GenerationCancelledError: the session was closed (the generation was cancelled).
            ModelNotReadyError: the target kept refusing the block after rebuilding it.
        """
        if self.closed:
            raise GenerationCancelledError("the generation was cancelled")
        msg = convert.draft_block_to_proto(
            block, self.session_id, len(self._history), open=self._open_msg() if self._needs_open else None
        )
        for _attempt in range(MAX_REBUILDS_PER_STEP + 1):
            payload = msg.SerializeToString()
            t0 = self._clock()
            self._sent = True
            raw = self._send_surviving_restarts(payload, msg)
            payload = msg.SerializeToString()  # `open` may have been added while retrying
            self.wire.round_trip_s += self._clock() - t0
            self.wire.bytes_sent += len(payload)
            self.wire.bytes_received += len(raw)
            if not msg.HasField("open"):
                self.wire.max_block_bytes = max(self.wire.max_block_bytes, len(payload))
            reply = xpb.VerificationResult.FromString(raw)
            self.wire.target_time_s += reply.target_time_s
            if reply.status == xpb.VERIFY_STATUS_OK:
                break
            if reply.status in (xpb.VERIFY_STATUS_SESSION_MISSING, xpb.VERIFY_STATUS_POSITION_MISMATCH):
                log.info("target session %s: %s; rebuilding from %d tokens", self.session_id,
                         xpb.VerifyStatus.Name(reply.status), len(self._history))
                msg.open.CopyFrom(self._open_msg())
                self.wire.rebuilds += 1
                continue
            raise ModelNotReadyError(f"target replied {xpb.VerifyStatus.Name(reply.status)}")
        else:
            raise ModelNotReadyError(f"the target could not rebuild session {self.session_id}")
        self.wire.steps += 1
        self.wire.per_step_bytes.append(len(payload) + len(raw))
        self._needs_open = False
        result = convert.verify_result_from_proto(reply, self.want_logprobs)
        self._history.extend(result.token_ids)
        if result.committed_len != len(self._history):
            raise ModelNotReadyError(
                f"target committed {result.committed_len} tokens, the draft side {len(self._history)}"
            )
        return result

    def _send_surviving_restarts(self, payload: bytes, msg: xpb.CandidateBlock) -> bytes:
        """``send("Verify")``, retried while the target replica is dead or restarting.

        A replacement replica has no session: the retried block carries ``open`` (full history).
        """
        from deployments.ray_errors import is_replica_death

        start, delay = time.monotonic(), 0.2
        while True:
            try:
                return self._send("Verify", payload)
            except Exception as e:
                if not is_replica_death(e) or time.monotonic() - start > TARGET_RESTART_BUDGET_S:
                    raise
                if self.closed:
                    raise GenerationCancelledError("the generation was cancelled") from None
                log.warning("target replica unavailable for %s (%s); retrying", self.session_id, type(e).__name__)
                time.sleep(delay)
                delay = min(2.0, delay * 2)
                if not msg.HasField("open"):
                    msg.open.CopyFrom(self._open_msg())
                    self.wire.rebuilds += 1
                payload = msg.SerializeToString()

    def close(self) -> None:
        """Free the remote session (CloseSession). Idempotent; transport errors are logged only."""
        if self.closed:
            return
        self.closed = True
        if not self._sent:  # never sent: the target holds nothing of it
            return
        try:
            self._send("CloseSession", xpb.CloseSessionRequest(session_id=self.session_id).SerializeToString())
        except Exception:  # the target replica may be gone; its table went with it
            log.warning("CloseSession(%s) failed", self.session_id, exc_info=True)


def handle_send(target_handle: Any, routing_key: str, timeout_s: float = VERIFY_TIMEOUT_S) -> Send:
    """A :data:`Send` over a Serve handle of the Target deployment, sticky on ``routing_key``.

    Blocking: call it from a worker thread, never from the replica's event loop.
    """
    handle = target_handle.options(session_id=routing_key)

    def send(method: str, payload: bytes) -> bytes:
        return getattr(handle, method).remote(payload).result(timeout_s=timeout_s)

    return send


class Draft:
    """One draft replica: the draft model, and the generations (loops) running on it.

    Args:
        cfg: the application config.
        target: a Serve handle of the Target deployment.
        send_factory: ``(routing_key) -> Send``; tests inject one, default :func:`handle_send`.
        metrics: :class:`deployments.metrics.SpecDecMetrics` (default: Ray's metrics API).
        controller: the shared-state client the acceptance counts of K under load are pooled in
            (:meth:`deployments.controller_actor.ControllerClient.auto` by default; pooled only
            when that is the shared actor, or when one is given).

    K under load (``cfg.served_batch_k``): :attr:`batch_k` (a
    :class:`specdec.control.batch_k.BatchKSessions`, next to the draft combiner) chooses the K of
    every step of a ``batch_adaptive`` job from the batch it runs in. It lives here, not in the
    shared controller actor, because K is needed before every step of every session: this
    replica sees its sessions' tenants, measures its own batched draft forwards, and gets the
    batched verify's rows, positions and seconds back in each verification result, while an
    actor call per step would put a round trip into every step.

    With several draft replicas each decides K for its own batch from its own measured costs,
    but acceptance is the tenant's: every ``cfg.batch_k_sync_s`` seconds (checked after a step)
    and when a generation ends the replica sends the steps it recorded to the shared controller actor and takes back the
    counts pooled over all replicas (:meth:`SyncBatchK`; the pooling is described in
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
            from specdec.models.loader import load_model
            from specdec.models.spec import parse_model_spec
            from specdec.models.vocab import VocabSide, check_vocab_compatible
            from specdec.engine.proposers.draft_model import DraftModelProposer

            from deployments.tp_worker import worker_device

            # the GPU Ray gave this replica (cuda:0 in its view); a clear error, not a silent CPU
            # run, when it holds one but this torch cannot use it
            device = worker_device(cfg.draft_num_gpus)
            draft = load_model(parse_model_spec(cfg.draft_model), device=device,
                               weight_format=cfg.draft_format(device.type),
                               vocab_subset=cfg.draft_vocab_subset, vocab_table=cfg.draft_vocab_table)
            check_vocab_compatible(VocabSide.of(draft), self.info.vocab_side())
            self.draft_proposer = DraftModelProposer(draft, eos_ids=self.info.eos_token_ids)
        #: generation id -> its Generation (the sessions whose draft caches live here)
        self.sessions: dict[str, Any] = {}
        self._gauged: dict[str, float] = {}  # tenant -> when its batch-K gauges were last set
        self._lock = threading.Lock()
        from deployments.metrics import SpecDecMetrics
        from specdec.control.batch_k import BatchKController, BatchKSessions, GoodputGuard
        from specdec.engine.draft_combiner import DraftCombiner

        self.metrics = metrics if metrics is not None else SpecDecMetrics()
        #: K under load per tenant (None: the router's K holds for every step)
        self.batch_k = (BatchKSessions(BatchKController(budget=cfg.max_batch_positions),
                                      trace=os.environ.get("SPECDEC_BATCH_K_TRACE") or None,
                                      guard=GoodputGuard() if cfg.batch_k_goodput_guard else None)
                        if cfg.served_batch_k else None)
        #: where the batch controller's acceptance counts are pooled with the other replicas'
        self.shared = None
        if self.batch_k is not None and cfg.batch_k_sync_s > 0:
            if controller is None:
                from deployments.controller_actor import ControllerClient

                controller = ControllerClient.auto()
                controller = controller if controller.is_shared else None  # alone: nothing to pool
            self.shared = controller
        self.replica_id = uuid.uuid4().hex
        self._synced_at = time.monotonic()
        self._sync_task: asyncio.Task | None = None
        self._sync_again = False
        #: batches the drafting of the generations stepped concurrently (continuous batching)
        self.combiner = DraftCombiner(batched=cfg.draft_batching, window_s=cfg.batch_window_s,
                                      max_prefill=cfg.draft_prefill_chunk, k_control=self.batch_k)

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

        def open_target(history, sampling, seed, *, logprobs, processing, top_logprobs):
            target = RemoteTargetSession(
                job.session_id, history, sampling, seed, logprobs, send,
                processing=processing if processing.active else None, top_logprobs=top_logprobs,
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
            k=k, resume=resume,
        )
        if self.batch_k is not None:
            self.batch_k.join(gen, tenant, req.speculation.proposer if req.speculation.k > 0 else "none",
                              adaptive=adaptive, weight=job.tenant_weight or 1.0,
                              k_range=(min(job.k_min, req.speculation.k), req.speculation.k),
                              prompt_tokens=len(prompt) if resume is None else 0, max_tokens=req.max_tokens)
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
                await asyncio.wait([fut])
            await loop.run_in_executor(self.step_executor, gen.close)
        finally:
            if self.batch_k is not None:
                self.batch_k.leave(gen)
                self._maybe_sync_batch_k(force=True)
            with self._lock:
                self.sessions.pop(sid, None)

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
        steps recorded since the last exchange to the shared controller actor, take back the
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

    async def Ready(self) -> bool:
        """True once this replica's model is loaded and the target deployment answers."""
        if self.target is not None:
            await self.target.Ready.remote()
        return True

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


def set_wire_stats(stats: pb.SpeculationStats, wire: WireStats) -> None:
    """Copy the draft <-> target wire numbers of one generation into its stats proto."""
    n = max(wire.steps, 1)
    stats.wire_bytes_per_step = wire.bytes_per_step
    stats.round_trip_s = wire.round_trip_s / n
    stats.target_compute_s = wire.target_time_s / n
