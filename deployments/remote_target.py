"""The target side of a generation stepped on a draft replica: a remote target session.

A draft replica (:mod:`deployments.draft`) runs the core :class:`specdec.engine.decoder.Generation`
loop of each generation; the loop's target is a :class:`RemoteTargetSession`: each speculation
step serializes one ``CandidateBlock`` proto and sends it to the Target deployment through a
Serve handle with ``.options(session_id=...)`` (ConsistentHashRouter keeps the session on one
target replica): **one round trip per step**. :class:`WireStats` counts that traffic.

Rebuilding instead of failing: when the target replica lost the session (restarted, or the
session moved after scaling) it answers SESSION_MISSING / POSITION_MISMATCH and the block is
resent with ``open`` built from the full token history; while the target replica is dead or
restarting, a step retries for :data:`TARGET_RESTART_BUDGET_S` (then with ``open``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from deployments import convert
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import GenerationCancelledError, ModelNotReadyError
from specdec.types import DraftBlock, VerifyResult

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
        prefix_scope: the session's prefix cache scope on the target (sent with ``open``;
            :func:`specdec.engine.prefix_cache.prefix_scope`).
    """

    def __init__(self, session_id: str, history, sampling, seed: int, logprobs: bool, send: Send,
                 clock: Callable[[], float] = time.perf_counter, processing: Any = None, top_logprobs: int = 0,
                 prefix_scope: str = ""):
        self.session_id = session_id
        self._history = [int(t) for t in history]
        self.sampling = sampling
        self.seed = seed
        self.want_logprobs = logprobs
        self.processing = processing
        self.top_logprobs = top_logprobs
        self.prefix_scope = prefix_scope
        self._send = send
        self._clock = clock
        self._needs_open = True
        self._sent = False  # a Verify went out: the target may hold this session
        self.closed = False
        #: cancel() told the target: a step in flight ends, nothing is rebuilt
        self.cancelled = False
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
                                            self.processing, self.top_logprobs, self.prefix_scope)
        msg.tenant, msg.tenant_weight = self.tenant, self.tenant_weight
        return msg

    def verify(self, block: DraftBlock) -> VerifyResult:
        """Send one block, get its verification (rebuilding the remote session when asked).

        Raises:
            GenerationCancelledError: the session was closed (the generation was cancelled;
                the target answers a block it dropped so, ``VERIFY_STATUS_CANCELLED``).
            ModelNotReadyError: the target kept refusing the block after rebuilding it.
        """
        if self.closed or self.cancelled:
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
            if reply.status == xpb.VERIFY_STATUS_CANCELLED:  # dropped unverified: the session was closed
                raise GenerationCancelledError("the target dropped the block unverified: its session was closed")
            if reply.status in (xpb.VERIFY_STATUS_SESSION_MISSING, xpb.VERIFY_STATUS_POSITION_MISMATCH):
                if self.cancelled:  # closed by cancel(): never rebuild (it would prefill again for nobody)
                    raise GenerationCancelledError("the generation was cancelled")
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

    def cancel(self) -> None:
        """Tell the target now that the generation is cancelled, while a step may still be in
        flight in another thread: CloseSession, so the target drops the block still waiting (the
        rest of a long prompt's chunked prefill: minutes on a CPU) instead of computing it for
        nobody; the step in flight then ends with GenerationCancelledError, never a rebuild.
        :meth:`close` still sends its own CloseSession after that step (a block that reached the
        target after this call is freed then). Transport errors are logged only."""
        if self.closed or self.cancelled:
            return
        self.cancelled = True
        if not self._sent:
            return
        try:
            self._send("CloseSession", xpb.CloseSessionRequest(session_id=self.session_id).SerializeToString())
        except Exception:  # the target replica may be gone; its table went with it
            log.warning("CloseSession(%s) on cancel failed", self.session_id, exc_info=True)

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


def set_wire_stats(stats: pb.SpeculationStats, wire: WireStats) -> None:
    """Copy the draft <-> target wire numbers of one generation into its stats proto."""
    n = max(wire.steps, 1)
    stats.wire_bytes_per_step = wire.bytes_per_step
    stats.round_trip_s = wire.round_trip_s / n
    stats.target_compute_s = wire.target_time_s / n
