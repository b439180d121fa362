"""Continuous batching of speculation steps: one scheduler steps many generations at once.

Each *tick* of :class:`BatchScheduler`:

1. admits the generations submitted since the last tick (a request whose block "arrives" while
   a forward runs joins the next tick) and ends the cancelled ones (their caches are freed);
2. asks every running generation for its K (:meth:`specdec.engine.decoder.Generation.plan`);
3. drafts: the draft-model sessions of all generations with one batched draft forward per
   draft position (:meth:`specdec.engine.proposers.draft_model.DraftModelProposer.propose_batch`),
   prompt lookup for all the others in the same tick;
4. verifies every block in one target forward over the sessions' own KV caches (ragged cache
   lengths, ragged K; :meth:`specdec.engine.verifier.TargetVerifier.verify_batch`), bounded by a
   positions budget Σ(K_i + 1): a new prompt is prefilled in chunks within the budget, so it
   stalls the running generations by at most one budget's worth of positions;
5. applies each row's result to its generation (:meth:`specdec.engine.decoder.Generation.apply`) and
   delivers the chunks.

Every row is decided exactly as alone (its own seeded generator per position), so each output
is the output of the same request run alone, whatever the batch composition.
``batched=False`` is the batch-size-1 switch: the same ticks, but every draft and every verify
runs alone (the unbatched path), for benchmarks that compare both in one run.

Fairness: each tenant gets its weighted max-min fair share of the positions budget
(:func:`specdec.engine.fairness.fair_budget_plan`, weights from the tenant policy): its rows within that share go first
(decode rows in weighted round robin rotating the first tenant every tick, then prefills shorter
first, a prefill chunked to what is left of its tenant's share), the rest only on leftover
budget. So a burst from one tenant cannot push another tenant's steps, or its new prompt's
prefill, out of the forwards: the other tenant progresses by its share every tick.

Prefix caching (:mod:`specdec.engine.prefix_cache`, when the engine's models have it on): by
default (``prefix_cache_scope="tenant"``, the serving layer's default ``AppConfig.prefix_cache_scope``)
a request's sequences start only from prefixes cached by requests of the same tenant (the
``tenant`` of :meth:`BatchScheduler.submit`), so one tenant cannot learn from a request's speed
whether another recently sent the same prompt prefix; ``"shared"``: from every request's. Either
way a request's ``cache_salt`` shares only with requests of the same salt (within the scope).

The parts, one job each: this module, the tick and its driving (:class:`BatchScheduler`);
:mod:`specdec.engine.batch_request` (the request handle and the tick record, re-exported here);
:mod:`specdec.engine.batch_draft` (step 3); :mod:`specdec.engine.batch_adaptive` (what the K
controller is told before step 2, and an adaptive request's K); :mod:`specdec.engine.fairness`
(the budget's fair order in step 4).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable, Literal, Sequence

from specdec.engine.batch_adaptive import TenantGuards, adaptive_k, decide_under_load
from specdec.engine.batch_draft import draft_blocks
from specdec.engine.batch_request import BatchedRequest, TickRecord
from specdec.engine.decoder import Generation
from specdec.engine.fairness import fair_budget_plan
from specdec.errors import GenerationCancelledError, InvalidRequestError
from specdec.request import GenerationRequest
from specdec.types import DraftBlock, FinishReason, GenerationChunk

__all__ = ["DEFAULT_MAX_BATCH_POSITIONS", "PREFIX_CACHE_SCOPES", "BatchScheduler", "BatchedRequest", "TickRecord",
           "VerifyFn"]

#: Default positions budget of one batched target forward (Σ over rows of fed positions).
DEFAULT_MAX_BATCH_POSITIONS = 64

#: ``BatchScheduler(prefix_cache_scope=...)``'s values, named as the serving layer's ``AppConfig.prefix_cache_scope``
PREFIX_CACHE_SCOPES = ("tenant", "shared")

#: ``verify(items, max_positions) -> results``: see :meth:`specdec.engine.verifier.TargetVerifier.verify_batch`.
VerifyFn = Callable[[Sequence[tuple[Any, DraftBlock]], "int | None"], list]


class BatchScheduler:
    """Steps many generations of one :class:`specdec.engine.engine.SpeculativeEngine` together.

    Args:
        engine: the engine whose verifier (and draft proposer) run the batched forwards.
        batched: False runs every draft and verify alone (the batch-size-1 path).
        max_batch_positions: positions budget of one target forward (≥ 1); chunked prefill
            keeps a new prompt within it.
        tenant_weights: tenant -> weight for the fair order of rows (default 1 each).
        verify: replaces the in-process verifier (a serving layer's remote target); same
            contract as :meth:`specdec.engine.verifier.TargetVerifier.verify_batch`.
        on_forward: called with the request ids of each tick's target forward just before it
            runs (tests use it to submit work "during" a forward).
        controller: a :class:`specdec.control.batch_k.BatchKController`: chooses K per tenant
            under the current load for requests submitted with ``adaptive=True``, and learns
            from every tick.
        guard: a :class:`specdec.control.goodput_guard.GoodputGuard` (with a ``controller``): one
            per tenant (its settings) overrules the controller with K = 0 while the tenant's
            speculation measures slower than plain decoding (:class:`specdec.engine.batch_adaptive.TenantGuards`,
            as served); None: the controller alone.
        clock: seconds clock.
        draft_prefill_chunk: chunked draft prefill: the draft model's uncached prompt tails
            fed per tick total at most this many positions (a longer prompt is prefilled in
            chunks over several ticks while the other sessions keep drafting and stepping;
            :meth:`specdec.engine.proposers.draft_model.DraftModelProposer.propose_batch`).
            Default: ``max_batch_positions``.
        prefix_cache_scope: which requests' cached prefixes a submitted request's draft and target
            sequences may start from, when the models have prefix caching on
            (:mod:`specdec.engine.prefix_cache`): ``"tenant"`` (the default, as served) only those
            of requests submitted with the same ``tenant``; ``"shared"`` every request's (and
            those :meth:`specdec.engine.engine.SpeculativeEngine.generate` runs left). Either way
            a ``cache_salt`` shares only with the same salt. Outputs are the same either way;
            only the positions computed differ.

    Raises:
        ValueError: ``max_batch_positions < 1``, ``draft_prefill_chunk < 1``, or a
            ``prefix_cache_scope`` other than ``"tenant"`` or ``"shared"``.
    """

    def __init__(
        self,
        engine: Any,
        *,
        batched: bool = True,
        max_batch_positions: int = DEFAULT_MAX_BATCH_POSITIONS,
        tenant_weights: dict[str, float] | None = None,
        verify: VerifyFn | None = None,
        on_forward: Callable[[list[int]], None] | None = None,
        controller: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        draft_prefill_chunk: int | None = None,
        guard: Any = None,
        prefix_cache_scope: Literal["tenant", "shared"] = "tenant",
    ):
        if prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be 'tenant' or 'shared', got {prefix_cache_scope!r}")
        if max_batch_positions < 1:
            raise ValueError(f"max_batch_positions must be >= 1, got {max_batch_positions}")
        if draft_prefill_chunk is not None and draft_prefill_chunk < 1:
            raise ValueError(f"draft_prefill_chunk must be >= 1, got {draft_prefill_chunk}")
        #: positions of draft prefill per tick (chunked draft prefill); default the target's budget
        self.draft_prefill_chunk = draft_prefill_chunk or max_batch_positions
        #: ``(rows, positions)`` of every batched draft forward (for tests and statistics)
        self.draft_trace: list[tuple[int, int]] = []
        self.engine = engine
        self.batched = batched
        self.max_batch_positions = max_batch_positions
        self.tenant_weights = dict(tenant_weights or {})
        #: "tenant": submitted requests share cached prefixes only within their tenant; "shared": all
        self.prefix_cache_scope = prefix_cache_scope
        self._verify = verify or engine.verifier.verify_batch
        self.on_forward = on_forward
        self.controller = controller
        #: the per-tenant goodput guards (None without ``guard`` or ``controller``)
        self.guards = TenantGuards(guard) if guard is not None and controller is not None else None
        self._clock = clock
        self._draft_timings: list[tuple[int, float]] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._incoming: list[BatchedRequest] = []
        self.running: list[BatchedRequest] = []
        self.trace: list[TickRecord] = []
        self._ticks = 0
        self._thread: threading.Thread | None = None
        self._stop = False

    # --- submitting ------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, tenant: str = "default", k=None,
               adaptive: bool = False) -> BatchedRequest:
        """Open a request's sessions and queue it for the next tick (thread-safe).

        Args:
            request: the validated request.
            tenant: tenant name (fair order, statistics, and under ``prefix_cache_scope``
                "tenant" the requests whose cached prefixes this one may start from).
            k: override of the largest K (an int or a callable asked before each step).
            adaptive: take K from the scheduler's controller (the tenant's K under the current
                load, at most the request's K; a probe's K now and then while the tenant is
                held at K = 0: :meth:`specdec.control.batch_k.BatchKController.step_k`).

        Raises:
            InvalidRequestError, PromptTooLongError, ContextLengthExceededError: as
                :meth:`specdec.engine.engine.SpeculativeEngine.start`.
            ValueError: ``adaptive`` without a controller.
        """
        if adaptive:
            if self.controller is None:
                raise ValueError("adaptive K needs a scheduler with a controller")
            cap = request.speculation.k
            k = (self.guards.k(self.controller, tenant, cap) if self.guards is not None
                 else adaptive_k(self.controller, tenant, cap))

        gen = self.engine.start(request, k=k,
                                prefix_tenant=tenant if self.prefix_cache_scope == "tenant" else "")
        req = self.add(gen, tenant=tenant, proposer=request.speculation.proposer)
        req.adaptive = adaptive
        return req

    def add(self, generation: Generation, *, tenant: str = "default", proposer: str = "none") -> BatchedRequest:
        """Queue an already started generation for the next tick (thread-safe).

        Its prefix cache scope is the one it was started with (``prefix_tenant`` of
        :meth:`specdec.engine.engine.SpeculativeEngine.start`), not ``tenant``: the scheduler's
        ``prefix_cache_scope`` applies to :meth:`submit` only."""
        req = BatchedRequest(id=next(self._ids), tenant=tenant, generation=generation, proposer=proposer)
        with self._lock:
            self._incoming.append(req)
            self._wake.notify_all()
        return req

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._incoming and not self.running

    # --- one tick --------------------------------------------------------------------------------

    def _finish(self, r: BatchedRequest, chunk: GenerationChunk | None) -> None:
        if chunk is not None:
            r.chunks.put(chunk)
        r.chunks.put(None)
        r._done.set()

    def _fail(self, r: BatchedRequest, error: BaseException) -> None:
        r.error = error
        try:
            r.generation.close()
        finally:
            r.chunks.put(error)
            r._done.set()

    def _end_cancelled(self, rows: list[BatchedRequest]) -> list[BatchedRequest]:
        keep = []
        for r in rows:
            if r._cancel:
                r.generation.assembler.finish(FinishReason.CANCELLED)
                self._finish(r, r.generation.finish_chunk())  # both sessions' caches freed
            else:
                keep.append(r)
        return keep

    def step(self) -> TickRecord | None:
        """Run one tick (see the module docstring); None when there was nothing to do."""
        with self._lock:
            self.running.extend(self._incoming)
            self._incoming = []
        tick = self._ticks
        self._ticks += 1
        self.running = self._end_cancelled(self.running)
        if self.controller is not None and self.running:
            decide_under_load(self.controller, self.running)
        # plan: K for each generation that needs a new block
        need: list[tuple[BatchedRequest, int]] = []
        alive: list[BatchedRequest] = []
        for r in self.running:
            if r.block is None:
                k = r.generation.plan()
                if k is None:
                    self._finish(r, r.generation.finish_chunk())
                    continue
                need.append((r, k))
            alive.append(r)
        self.running = alive
        if not alive:
            return None
        # draft
        t0 = self._clock()
        self._draft(need)
        t1 = self._clock()
        for r, _ in need:
            r.draft_s = t1 - t0
            r.block_tick = tick
        alive = [r for r in alive if r.block is not None]  # the others' draft prefill is chunked
        if not alive:
            rec = TickRecord([], [], 0, 0, t1 - t0, 0.0)
            self.trace.append(rec)
            return rec
        # verify
        # fair shares of the budget by tenant; decode rows first, then prefills, shorter first
        order, caps = fair_budget_plan(
            sorted(alive, key=lambda r: (r.block_tick, r.id)), lambda r: r.tenant, self._uncached,
            lambda r: self._uncached(r) if self._uncached(r) > r.block.k + 1 else 0,
            self.tenant_weights, self.max_batch_positions if self.batched else None, tick)
        items = [(r.generation.target, r.block) for r in order]
        if self.on_forward is not None:
            self.on_forward([r.id for r in order])
        positions = sum(self._uncached(r) for r in order)
        t2 = self._clock()
        try:
            if self.batched:
                results = (self._verify(items, self.max_batch_positions, caps) if any(c is not None for c in caps)
                           else self._verify(items, self.max_batch_positions))
            else:
                results = [self._verify([item], None)[0] for item in items]
        except Exception as e:  # the forward failed: every row in it may be half-advanced
            for r in order:
                self._fail(r, e)
            self.running = []
            return TickRecord([r.id for r in order], [], positions, 0, t1 - t0, self._clock() - t2)
        t3 = self._clock()
        answered = []
        guarded: list[tuple[int, str, int, int]] = []  # adaptive rows for the goodput guards
        for r, res in zip(order, results):
            if res is None:
                continue  # chunked or deferred: the block waits for the next tick
            block, r.block = r.block, None
            if isinstance(res, BaseException):
                self._fail(r, res if isinstance(res, InvalidRequestError) or not isinstance(res, ValueError)
                           else InvalidRequestError(str(res)))
                continue
            answered.append(r.id)
            if self.controller is not None and block.k > 0:
                self.controller.observe_row(r.tenant, r.proposer, block.k, res.accepted)
            if r.adaptive and r.proposer != "none":
                guarded.append((r.id, r.tenant, block.k, res.accepted))
            if r._cancel:
                continue  # ended at the top of the next tick
            chunk = r.generation.apply(block, res, r.draft_s, t3 - t2)
            if r.generation.finished:
                self._finish(r, chunk)
            elif chunk is not None:
                r.chunks.put(chunk)
        self.running = [r for r in self.running if not r.done]
        # unbatched: every row was its own forward over all of its positions (no budget)
        fed = (getattr(getattr(self._verify, "__self__", None), "last_positions", positions) if self.batched
               else positions)
        context = getattr(getattr(self._verify, "__self__", None), "last_context", None) if self.batched else None
        rec = TickRecord([r.id for r in order], answered, positions, fed, t1 - t0, t3 - t2, context)
        if self.controller is not None and self.batched:
            fed_rows = sum(1 for res in results if res is not None) or 1
            self.controller.observe_tick(fed_rows, max(fed, fed_rows), t3 - t2, self._draft_timings, context=context)
        if self.guards is not None and self.batched:
            self.guards.record_tick(self.controller, guarded, t3 - t0)
        self._draft_timings = []
        self.trace.append(rec)
        return rec

    @staticmethod
    def _uncached(r: BatchedRequest) -> int:
        """Positions the row's next forward feeds: uncached committed tail + K drafts."""
        target = r.generation.target
        seq = getattr(target, "seq", None)
        if seq is None:  # a remote target: only the block is known here
            return r.block.k + 1
        tail = target.committed_len - min(len(seq.cached), target.committed_len)
        return max(tail, 1) + r.block.k

    def _draft(self, need: list[tuple[BatchedRequest, int]]) -> None:
        """Draft the blocks of ``need``: batched per draft proposer, prompt lookup alone."""
        self._draft_timings += draft_blocks(need, batched=self.batched, max_prefill=self.draft_prefill_chunk,
                                            controller=self.controller, draft_trace=self.draft_trace)

    # --- driving ---------------------------------------------------------------------------------

    def run_until_idle(self) -> None:
        """Tick in this thread until every submitted generation has ended."""
        while not self.idle:
            self.step()

    def start(self) -> None:
        """Tick in a background thread (idle waits for work) until :meth:`shutdown`."""
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specdec-batch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._incoming and not self.running:
                    self._wake.wait()
                if self._stop:
                    return
            self.step()

    def shutdown(self) -> None:
        """Stop the background thread after its tick; cancel and free what still runs."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            rest, self._incoming = self.running + self._incoming, []
            self.running = []
        for r in rest:
            self._fail(r, GenerationCancelledError("the scheduler shut down"))
