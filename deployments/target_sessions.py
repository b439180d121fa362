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

    def __len__(self) -> int:
        return len(self.sessions)

    def handle(self, msg: xpb.CandidateBlock) -> xpb.VerificationResult:
        """Verify one candidate block (see the module docstring for the statuses).

        Raises:
            InvalidRequestError: ``open`` whose history length differs from ``position``, or a
                block the verifier rejects (ids out of range, past the context limit).
        """
        t0 = self.clock()
        session = self.sessions.get(msg.session_id)
        if msg.HasField("open"):
            ids, sampling, seed, logprobs = convert.session_open_from_proto(msg.open)
            if len(ids) != msg.position:
                raise InvalidRequestError(f"open carries {len(ids)} tokens but the block follows position {msg.position}")
            if session is not None:
                session.close()
            try:
                session = self.verifier.open_session(ids, sampling, seed, logprobs,
                                                     **convert.session_open_options(msg.open))
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            self.sessions[msg.session_id] = session
        elif session is None:
            return xpb.VerificationResult(status=xpb.VERIFY_STATUS_SESSION_MISSING)
        elif session.committed_len != msg.position:
            return xpb.VerificationResult(
                status=xpb.VERIFY_STATUS_POSITION_MISMATCH, target_position=session.committed_len
            )
        try:
            result = session.verify(convert.draft_block_from_proto(msg))
        except BaseException as e:
            # A failed verify may leave the session half-advanced: drop it (a retry rebuilds
            # it from the token history) rather than keep caches nobody will close.
            self.close(msg.session_id)
            if isinstance(e, ValueError):
                raise InvalidRequestError(str(e)) from None
            raise
        return convert.verify_result_to_proto(result, target_time_s=self.clock() - t0)

    def close(self, session_id: str) -> bool:
        """Free one session's caches; returns whether it existed. Idempotent."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            session.close()
        return session is not None

    def close_all(self) -> None:
        for sid in list(self.sessions):
            self.close(sid)
