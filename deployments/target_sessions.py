"""The target side of the draft <-> target exchange: a table of target sessions keyed by id.

One :class:`TargetSessionTable` per target model (per TP rank when tensor-parallel: every rank
holds the same table and runs the same calls, so caches stay in lockstep). It turns one
``CandidateBlock`` into one ``VerificationResult``:

- ``open`` set: (re)open the session from the full token history, then verify;
- unknown session: reply SESSION_MISSING (the replica restarted or the session moved);
- known session at another position: reply POSITION_MISMATCH (e.g. a retried step);
- otherwise verify with :meth:`specdec.engine.verifier.TargetSession.verify`.

A rebuilt session draws each step's randomness from (``open.seed``, position), like the
session it replaces, so a seeded sampled generation gives the same output with or without a
rebuild.

Idle sessions (a consistent-hash remap after autoscaling, a failed CloseSession, a failed resume)
are freed by the Target replica after ``AppConfig.target_session_idle_timeout_s``
(:class:`SessionActivity`, swept from its periodic health check).
"""

from __future__ import annotations

import time

from deployments import convert
from protos.specdec.v1 import exchange_pb2 as xpb
from specdec.errors import InvalidRequestError


class SessionActivity:
    """When each session of a target replica was last used, and which are idle.

    The Target replica (not each TP rank) keeps it, so that every rank frees the same sessions
    in the same order as the blocks it receives.

    Args:
        idle_timeout_s: a session unused for longer than this is idle.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, idle_timeout_s: float, clock=time.monotonic):
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self.idle_timeout_s = float(idle_timeout_s)
        self.clock = clock
        self._last: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._last)

    def touch(self, session_id: str) -> None:
        """``session_id`` was used now."""
        self._last[session_id] = self.clock()

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)

    def sessions(self) -> list[str]:
        """Ids of the sessions in use (touched and not forgotten)."""
        return list(self._last)

    def idle(self) -> list[str]:
        """Ids of the sessions unused for longer than ``idle_timeout_s``, oldest first."""
        now = self.clock()
        return [sid for sid, t in sorted(self._last.items(), key=lambda kv: kv[1]) if now - t > self.idle_timeout_s]


class TargetSessionTable:
    """Target sessions of one replica (or one TP rank), keyed by session id.

    Args:
        verifier: a :class:`specdec.engine.verifier.TargetVerifier` (anything with ``open_session``).
        clock: seconds clock, injectable for tests.
    """

    def __init__(self, verifier, clock=time.perf_counter):
        self.verifier = verifier
        self.clock = clock
        self.sessions: dict = {}
        #: ticket -> (session id, block, arrival time): admitted blocks waiting for a forward
        self.pending: dict[int, tuple[str, object, float]] = {}
        #: tickets dropped since the last step (their session was closed or superseded)
        self._dropped: list[tuple[int, str]] = []
        #: session id -> (tenant, weight) from its ``open`` (fair order of batched forwards)
        self.tenants: dict[str, tuple[str, float]] = {}
        #: target forwards run, of :meth:`step` and :meth:`handle` alike (``BatchShape.forward``)
        self._steps = 0

    def __len__(self) -> int:
        return len(self.sessions)

    def handle(self, msg: xpb.CandidateBlock) -> xpb.VerificationResult:
        """Verify one candidate block alone (the unbatched path, batch size 1; see the module
        docstring for the statuses).

        The reply carries its forward's :class:`specdec.types.BatchShape` as a batched reply does
        (:meth:`step`), so the draft replica's K-under-load cost model learns from unbatched
        forwards too: ``forward`` counts the forwards of both paths (one counter), ``rows`` 1,
        ``positions`` what it fed (the session's uncached committed tail: a new or rebuilt
        session's prompt or history less what the target's prefix cache held; plus the K
        drafts), ``seconds`` the wall seconds of its :meth:`TargetSession.verify` (check,
        forward, decide; as :meth:`step` times its ``verify_batch``), ``context`` the tokens
        cached for the session before it. The shape is read from the verifier's ``last_*``
        attributes right after the forward: callers are serialized (the TP worker's actor runs
        one call at a time), as for :meth:`step`.

        Raises:
            InvalidRequestError: ``open`` whose history length differs from ``position``, or a
                block the verifier rejects (ids out of range, past the context limit).
        """
        t0 = self.clock()
        session = self._open_or_check(msg)
        if isinstance(session, xpb.VerificationResult):
            return session
        try:
            block = convert.draft_block_from_proto(msg)
            t_fwd = self.clock()
            result = session.verify(block)
        except BaseException as e:
            # A failed verify may leave the session half-advanced: drop it (a retry rebuilds
            # it from the token history) rather than keep caches nobody will close.
            self.close(msg.session_id)
            if isinstance(e, ValueError):
                raise InvalidRequestError(str(e)) from None
            raise
        now = self.clock()
        from specdec.types import BatchShape

        self._steps += 1
        shape = BatchShape(self._steps, getattr(self.verifier, "last_rows", 1),
                           getattr(self.verifier, "last_positions", block.k + 1), now - t_fwd,
                           getattr(self.verifier, "last_context", None))
        return convert.verify_result_to_proto(result, target_time_s=now - t0, batch=shape)

    # --- batched path (continuous batching) ---------------------------------------------------

    def _open_or_check(self, msg: xpb.CandidateBlock):
        """The session a block is verified with (opened from ``msg.open`` with the request's
        logit processing and top-N logprobs, or looked up), or a status reply
        (SESSION_MISSING, POSITION_MISMATCH). Shared by :meth:`handle` and :meth:`admit`.

        Raises:
            InvalidRequestError: an ``open`` whose tokens don't match the position, or ids the
                verifier refuses.
        """
        session = self.sessions.get(msg.session_id)
        if msg.HasField("open"):
            ids, sampling, seed, logprobs = convert.session_open_from_proto(msg.open)
            if len(ids) != msg.position:
                raise InvalidRequestError(f"open carries {len(ids)} tokens but the block follows position {msg.position}")
            if session is not None:
                self.close(msg.session_id)
            try:
                session = self.verifier.open_session(ids, sampling, seed, logprobs,
                                                     **convert.session_open_options(msg.open))
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            self.sessions[msg.session_id] = session
            self.tenants[msg.session_id] = (msg.open.tenant, msg.open.tenant_weight or 1.0)
            return session
        if session is None:
            return xpb.VerificationResult(status=xpb.VERIFY_STATUS_SESSION_MISSING)
        if session.committed_len != msg.position:
            return xpb.VerificationResult(
                status=xpb.VERIFY_STATUS_POSITION_MISMATCH, target_position=session.committed_len
            )
        return session

    def admit(self, ticket: int, msg: xpb.CandidateBlock) -> xpb.VerificationResult | None:
        """Take one block for the next batched forward (:meth:`step`).

        Returns:
            a status reply to send now (SESSION_MISSING, POSITION_MISMATCH), or None when the
            block waits for :meth:`step`.

        Raises:
            InvalidRequestError: as :meth:`handle` (bad ``open``, a malformed block); the session
                is then not kept.
        """
        for t, (sid, _, _) in list(self.pending.items()):
            if sid == msg.session_id:  # a retried step supersedes the one still waiting
                del self.pending[t]
                self._dropped.append((t, "superseded by a newer block of the same session"))
        got = self._open_or_check(msg)
        if isinstance(got, xpb.VerificationResult):
            return got
        try:
            block = convert.draft_block_from_proto(msg)
            got.check(block)
        except ValueError as e:
            self.close(msg.session_id)
            if isinstance(e, InvalidRequestError):
                raise
            raise InvalidRequestError(str(e)) from None
        self.pending[ticket] = (msg.session_id, block, self.clock())
        return None

    def step(self, max_positions: int | None) -> list[tuple[int, xpb.VerificationResult | Exception]]:
        """Verify the waiting blocks in one batched forward (positions budget ``max_positions``).

        Blocks are offered by tenant within each tenant's fair share of the budget
        (:func:`specdec.engine.fairness.fair_budget_plan`; tenant and weight from each session's
        ``open``; arrival order within a tenant), decode rows before prefills (an uncached prompt
        tail), shorter prefills first; a prefill is chunked within its tenant's share and its
        block answered when its last chunk runs (:meth:`specdec.verifier.TargetVerifier.verify_batch`).

        Returns:
            ``(ticket, reply or exception)`` for every ticket decided (and every ticket dropped
            since the last step, as :class:`specdec.errors.GenerationCancelledError`).

        Raises:
            Whatever the forward raised; every session in it is closed and its ticket dropped.
        """
        from specdec.errors import GenerationCancelledError

        out: list[tuple[int, xpb.VerificationResult | Exception]] = [
            (t, GenerationCancelledError(why)) for t, why in self._dropped
        ]
        self._dropped = []
        from specdec.engine.fairness import fair_budget_plan

        def tail(t: int) -> int:
            seq = self.sessions[self.pending[t][0]].seq
            return len(seq.token_ids) - min(len(seq.cached), len(seq.token_ids))

        def prefill_len(t: int) -> int:  # 0 for a decode row
            return tail(t) if tail(t) > 1 else 0

        tickets, caps = fair_budget_plan(
            list(self.pending), lambda t: self.tenants.get(self.pending[t][0], ("", 1.0))[0],
            lambda t: max(tail(t), 1) + self.pending[t][1].k, prefill_len,
            {ten: w for ten, w in self.tenants.values()}, max_positions, self._steps,
        )
        self._steps += 1
        items = [(self.sessions[self.pending[t][0]], self.pending[t][1]) for t in tickets]
        t_fwd = self.clock()
        try:
            results = self.verifier.verify_batch(items, max_positions, caps) if items else []
        except BaseException:
            for t in tickets:
                self.close(self.pending[t][0])
            raise
        now = self.clock()
        from specdec.types import BatchShape

        shape = BatchShape(self._steps, getattr(self.verifier, "last_rows", len(items)),
                           getattr(self.verifier, "last_positions", 0), now - t_fwd,
                           getattr(self.verifier, "last_context", None)) if items else None
        for t, res in zip(tickets, results):
            if res is None:
                continue
            sid, _, t0 = self.pending.pop(t)
            if isinstance(res, Exception):
                self.close(sid)
                # a bad block (ValueError) is the caller's; anything else (a failure deciding
                # this row alone) keeps its type, as in handle()
                bad = isinstance(res, ValueError) and not isinstance(res, InvalidRequestError)
                out.append((t, InvalidRequestError(str(res)) if bad else res))
            else:
                out.append((t, convert.verify_result_to_proto(res, target_time_s=now - t0, batch=shape)))
        return out

    def close(self, session_id: str) -> bool:
        """Free one session's caches; returns whether it existed. Idempotent.

        A block of the session still waiting for a batched forward is dropped (answered as
        cancelled by the next :meth:`step`).
        """
        for t, (sid, _, _) in list(self.pending.items()):
            if sid == session_id:
                del self.pending[t]
                self._dropped.append((t, "the session was closed"))
        session = self.sessions.pop(session_id, None)
        self.tenants.pop(session_id, None)
        if session is not None:
            session.close()
        return session is not None

    def close_all(self) -> None:
        for sid in list(self.sessions):
            self.close(sid)
