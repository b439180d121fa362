"""The ingress of both APIs: admits a request, decides K and the proposer, relays the draft's stream.

Plain class (decorated in :mod:`deployments.app` with Serve's FastAPI ingress). Two front doors,
one code path behind them:

- gRPC: method names equal the RPC names of ``specdec.v1.SpecDec``; Serve's gRPC proxy routes
  ``/specdec.v1.SpecDec/Generate`` to :meth:`Router.Generate`, passing the deserialized request
  and a ``grpc_context``. No exception ever leaves a method: errors are set on the context
  (:func:`deployments.grpc_status.abort_with`), else Serve would answer INTERNAL.
- HTTP: the OpenAI-compatible API of :mod:`deployments.openai_api`, built per replica by
  :meth:`Router.__serve_build_asgi_app__` and served through Serve's HTTP proxy. It translates
  the OpenAI body into the same request dict and calls the same :meth:`Router.generate_stream`.

Both hand :meth:`Router.generate_stream` the plain request dict that
:func:`specdec.request.parse_request` validates and the caller's metadata (``authorization``,
``session_id``, ``specdec-timeout-s``). Per request, in order (one clear step each):

1. ``TenancyGate.authenticate_caller``: the API key (UNAUTHENTICATED / HTTP 401), before any
   other work, so an unauthenticated caller cannot make the router validate or tokenize a
   large prompt;
2. ``parse_request``: dict -> validated core request (INVALID_ARGUMENT / HTTP 400), the same
   messages on both APIs;
3. ``_hints``: the request's proposer and largest K, capped by ``default_max_k``;
4. ``_encode``: tokenize (chat template of the target) and check the context limit
   (INVALID_ARGUMENT for an empty or over-long prompt);
5. ``TenancyGate.admit`` (:mod:`deployments.tenancy`) for the authenticated tenant: its policy
   (INVALID_ARGUMENT, or K clipped), its limits (RESOURCE_EXHAUSTED; the rate lease lives as
   long as the request's own timeout), a fair admission slot, and the K of the shared per-tenant
   controller (K = 0: plain decoding);
6. ``_ensure_ready``: the models are loaded (else UNAVAILABLE within ``ready_timeout_s``);
7. ``_relay``: one ``DraftJob`` to the Draft deployment (sticky on the session id), whose
   stream of chunks is relayed as is. The router is not in the per-token path: the draft replica
   runs the loop and talks to the target itself. If the draft replica dies mid-stream, the
   generation is resumed on a (new) draft replica from what the client already received.

Deadlines: the client's gRPC deadline is not visible through Serve's proxy context (Ray 2.60's
``RayServegRPCContext`` has no ``time_remaining()``), so the client library also sends it as
metadata ``specdec-timeout-s`` (seconds); the server stops at ``min(that, request_timeout_s)``
and answers DEADLINE_EXCEEDED. When the client's own deadline fires first, gRPC cancels the call
and Serve cancels the router's and the draft's tasks: the generation stops and frees its caches.

An HTTP client that disconnects gets its request cancelled by Serve's HTTP proxy, which ends
the generation the same way as a cancelled gRPC call.

Every admitted request ends with ``TenancyGate.complete`` (success, error or cancellation): the
fair slot and rate lease are released, the controller learns from the request's speculation
counters, and the metrics are recorded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping, Sequence

from deployments import convert
from deployments.aio import finish_despite_cancellation
from deployments.config import AppConfig
from deployments.grpc_status import abort_stream, abort_with
from deployments.metadata import APPLICATION_KEY, MAX_SESSION_ID_CHARS, SESSION_KEY, TIMEOUT_KEY
from deployments.ray_errors import is_replica_death, unwrap
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelNotReadyError,
    PromptTooLongError,
)
from specdec.request import MAX_SPECULATION_LENGTH, GenerationRequest, parse_request

log = logging.getLogger(__name__)


class PromptTooManyCharactersError(PromptTooLongError):
    """A prompt refused before tokenizing: more characters than the context's positions can
    spell (INVALID_ARGUMENT; OpenAI code ``context_length_exceeded``, as a tokenized prompt over
    the context). ``prompt_tokens`` is None (not tokenized); ``limit`` is the context in positions."""

    def __init__(self, message: str, limit: int):
        InvalidRequestError.__init__(self, message)
        self.prompt_tokens = None
        self.limit = limit

#: How many times one generation is resumed after its draft replica died.
MAX_RESUMES = 3


def _remaining(deadline_unix_s: float) -> float | None:
    """Seconds until ``deadline_unix_s`` (at least 0), or None without a deadline (0)."""
    return max(0.0, deadline_unix_s - time.time()) if deadline_unix_s else None


def metadata_dict(grpc_context: Any) -> dict[str, str]:
    """The invocation metadata of a call as a dict (empty without a context)."""
    if grpc_context is None:
        return {}
    return {k: v for k, v in grpc_context.invocation_metadata()}


def check_session_id(metadata: Mapping[str, str]) -> None:
    """Refuse a session id longer than :data:`MAX_SESSION_ID_CHARS` (gRPC metadata
    ``session_id``, HTTP header ``x-session-id``).

    Raises:
        InvalidRequestError: naming both spellings of the key, the length and the limit.
    """
    sid = metadata.get(SESSION_KEY)
    if sid is not None and len(sid) > MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"metadata {SESSION_KEY} (HTTP header x-session-id) is {len(sid)} characters; "
                                  f"at most {MAX_SESSION_ID_CHARS}")


def check_application(metadata: Mapping[str, str], app_name: str) -> None:
    """Refuse a gRPC call whose ``application`` metadata names another Serve application.

    Serve's gRPC proxy routes a call to the only application whatever name it carries
    (``ProxyRouter.get_handle_for_endpoint``: "or if there is only one endpoint"), so a client
    configured for another application would be answered by this one. No metadata is fine (the
    README: optional with one application).

    Raises:
        ModelNotFoundError: (NOT_FOUND) with Serve's own wording for an unknown application.
    """
    name = metadata.get(APPLICATION_KEY)
    if name is not None and name != app_name:
        raise ModelNotFoundError(f"Application '{name}' not found; this server serves the application '{app_name}'")


def _refuse_undecodable(request: Any) -> None:
    """Raise InvalidRequestError for an :class:`deployments.servicer.UndecodableRequest`."""
    from deployments.servicer import UndecodableRequest

    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.describe())


class RelayProgress:
    """What the router holds of a generation it relays, to resume it on another draft replica.

    The ids and characters the client received, and the checkpoint the draft replica reported
    with the last chunk (``DraftChunkTrailer``: the tokens that step committed but the chunk held
    back, and the step count). Together they end where a speculation step ended, the only place
    a seeded sampled generation can resume from and continue as it would have (each step's
    random streams are keyed by the position the step starts from).
    """

    def __init__(self) -> None:
        self.sent_ids: list[int] = []
        self.sent_chars = 0
        self.trailer = xpb.DraftChunkTrailer()

    def see(self, raw: bytes) -> pb.GenerateStreamChunk:
        """Record one chunk's bytes from the draft replica; return the chunk for the client.

        The trailer (fields unknown to GenerateStreamChunk) is read and dropped; a chunk without
        one (the last, or from an older draft replica) leaves nothing held.
        """
        chunk = pb.GenerateStreamChunk.FromString(raw)
        chunk.DiscardUnknownFields()
        self.trailer = xpb.DraftChunkTrailer.FromString(raw)
        self.trailer.DiscardUnknownFields()
        self.sent_ids.extend(chunk.token_ids)
        self.sent_chars += len(chunk.text)
        return chunk

    def fill(self, job: xpb.DraftJob) -> None:
        """Set ``job``'s resume fields to continue after what was relayed (nothing at first)."""
        for name in ("resume_token_ids", "resume_held_token_ids", "resume_held_logprobs", "resume_held_top_logprobs"):
            job.ClearField(name)
        job.resume_token_ids.extend(self.sent_ids)
        job.resume_text_chars = self.sent_chars
        job.resume_held_token_ids.extend(self.trailer.held_token_ids)
        job.resume_held_logprobs.extend(self.trailer.held_logprobs)
        job.resume_held_top_logprobs.extend(self.trailer.held_top_logprobs)
        job.resume_steps = self.trailer.steps


class Router:
    """Ingress of the SpecDec service.

    Args:
        cfg: the application config.
        draft: handle of the Draft deployment.
        target: handle of the Target deployment (readiness checks only).
        info: the target's :class:`deployments.target_info.TargetInfo` (tests inject one).
    """

    def __init__(self, cfg: AppConfig, draft: Any = None, target: Any = None, info: Any = None, gate: Any = None):
        from deployments.target_info import TargetInfo
        from deployments.tenancy import TenancyGate

        self.cfg = cfg
        self.draft = draft
        self.target = target
        self.info = info if info is not None else TargetInfo.load(cfg.target_model, cfg.target_format())
        self.gate = gate if gate is not None else TenancyGate.from_config(cfg)
        self._ready = False
        self.resumes = 0
        #: tokenizes prompts off the event loop: one thread per request the replica may run at
        #: once (Serve's max_ongoing_requests), not the loop's default pool sized by the host's cores
        self.encode_executor = ThreadPoolExecutor(max_workers=cfg.router.max_ongoing_requests,
                                                  thread_name_prefix="specdec-tokenize")
        #: longest vocabulary entry, in characters: a text of n characters is at least
        #: n / this many tokens (byte-level and SentencePiece vocabularies spell every decoded
        #: character with at least one character of the entry)
        self._max_token_chars = max((len(t) for t in self.info.tokenizer.get_vocab()), default=1) or 1

    # --- the steps before generation ---------------------------------------------------------

    def _default_proposers(self) -> list[str]:
        """The proposers this server runs, in order of preference (for requests naming none)."""
        return ["draft", "ngram"] if self.cfg.draft_model else ["ngram"]

    def _hints(self, data: Mapping[str, Any]) -> tuple[str, int]:
        """The request's proposer and largest K, capped by the server's ``default_max_k``
        (except for prompt lookup, whose K is a cap on free drafts: only the request's own K and,
        later, the tenant's ``k_max`` bound it).

        Args:
            data: the request dict (:func:`specdec.request.parse_request`'s input), already
                validated; ``data["speculation"]`` holds only what the caller set.

        Raises:
            InvalidRequestError: the request asks for the draft proposer but none is served.
        """
        spec = data.get("speculation") or {}
        proposer = spec.get("proposer")
        if proposer is None:
            proposer = "draft" if self.cfg.draft_model else "ngram"
        if proposer == "draft" and not self.cfg.draft_model:
            raise InvalidRequestError("proposer 'draft' needs a draft model; this server has none")
        if proposer == "ngram":
            # prompt lookup drafts cost nothing and K is only a cap on its blocks: the server's
            # default_max_k (sized for a draft model) does not apply; the tenant's k_max does
            # (in the gate), and the controller picks the cap from the block lengths it measures
            k = MAX_SPECULATION_LENGTH if spec.get("k") is None else int(spec["k"])
        else:
            k = self.cfg.default_max_k if spec.get("k") is None else min(int(spec["k"]), self.cfg.default_max_k)
        if proposer == "none":
            k = 0
        return proposer, int(k)

    def _refuse_too_many_messages(self, data: Mapping[str, Any]) -> None:
        """Refuse a chat request with more than ``max_chat_messages`` messages before validating
        or templating them: the characters check below counts only the messages' contents, and
        the template text each message adds (50,000 empty messages) would be tokenized first.

        Raises:
            InvalidRequestError: too many messages.
        """
        messages = data.get("messages")
        limit = self.cfg.max_chat_messages
        if isinstance(messages, (list, tuple)) and len(messages) > limit:
            raise InvalidRequestError(f"messages: {len(messages)} messages are more than this server's limit of "
                                      f"{limit} (max_chat_messages)")

    def _refuse_surely_too_long(self, req: GenerationRequest) -> None:
        """Refuse a text that cannot fit however it tokenizes, without tokenizing it (a 10 MB
        prompt takes seconds to tokenize).

        Raises:
            InvalidRequestError: more characters than ``max_positions`` tokens can spell.
        """
        if req.prompt is not None:
            chars = len(req.prompt)
        elif req.messages is not None:
            chars = sum(len(m.content) for m in req.messages)
        else:
            return
        most = self.info.max_positions * self._max_token_chars
        if chars > most:
            raise PromptTooManyCharactersError(
                f"prompt is {chars} characters: more than the {self.info.max_positions} positions of "
                f"the target '{self.info.name}' can hold (at most {most} characters)", self.info.max_positions
            )

    def _encode(self, req: GenerationRequest) -> list[int]:
        from specdec.engine.engine import encode_prompt

        ids = encode_prompt(self.info.tokenizer, req, self.info.emittable_vocab)
        if len(ids) >= self.info.max_positions:
            raise PromptTooLongError(len(ids), self.info.max_positions, f"the target '{self.info.name}'")
        return ids

    def _deadline(self, metadata: Mapping[str, str]) -> float:
        """Unix time by which the request must end (client's deadline, capped by the server's)."""
        budget = self.cfg.request_timeout_s
        raw = metadata.get(TIMEOUT_KEY)
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                seconds = math.nan
            if not math.isfinite(seconds):
                raise InvalidRequestError(f"metadata {TIMEOUT_KEY} must be a finite number of seconds, got {raw!r}")
            if seconds <= 0:  # no time at all: not admitted, nothing generated
                raise DeadlineExceededError(f"the request's deadline had passed before it started ({TIMEOUT_KEY} {raw})")
            budget = min(budget, seconds)
        return time.time() + budget

    async def _ensure_ready(self) -> None:
        """Raise ModelNotReadyError unless the draft and target replicas answer within the timeout."""
        if self._ready or self.draft is None:
            return
        try:
            await asyncio.wait_for(self._ask_ready(), timeout=self.cfg.ready_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise ModelNotReadyError("the models are still loading; retry in a few seconds") from None
        except Exception as e:
            raise ModelNotReadyError(f"the models are not available: {unwrap(e)}") from None
        self._ready = True

    async def _ask_ready(self) -> None:
        await self.draft.Ready.remote()

    def _job(self, req: GenerationRequest, adm: Any, prompt: Sequence[int], session_id: str,
             deadline: float) -> xpb.DraftJob:
        msg = convert.request_to_proto(req)
        msg.prompt_token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))  # the oneof now holds the ids
        # K under load (the gate's batch_adaptive): the draft replica picks each step's K, at most
        # the request's ceiling; the per-request controller was not asked (deployments.tenancy)
        batch_adaptive = bool(getattr(adm, "batch_adaptive", False))
        k = adm.k_cap if batch_adaptive else (adm.chosen_k if adm.proposer != "none" else 0)
        msg.speculation.CopyFrom(pb.SpeculationHints(
            proposer=convert.PROPOSER_TO_PROTO[adm.proposer], max_k=k,
            draft_min_confidence=req.speculation.draft_min_confidence,
        ))
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
        msg.sampling.seed = seed
        # a probe of the per-request controller (never for a batch-adaptive job: the draft
        # replica's controller re-probes a tenant it holds at K = 0)
        probe = int(adm.decision.get("probe_steps") or 0) if adm.decision.get("probe") and not batch_adaptive else 0
        return xpb.DraftJob(session_id=session_id, request=msg, deadline_unix_s=deadline, probe_steps=probe,
                            tenant=adm.tenant_id, tenant_weight=getattr(adm, "batch_weight", 1.0),
                            batch_adaptive=batch_adaptive, k_min=min(getattr(adm, "k_min", 0), k) if batch_adaptive else 0)

    @staticmethod
    def _default_max_tokens(data: Mapping[str, Any], tenant: Any, default: int | None) -> Mapping[str, Any]:
        """``data`` with ``max_tokens`` set when the caller left it out: ``default`` (the
        server's, :class:`GenerationRequest`'s, when None), at most the tenant's
        ``limits.max_tokens``. A default is the server's choice, so it never makes a request
        fail a tenant limit; a ``max_tokens`` the caller set over the limit still does."""
        if data.get("max_tokens") is not None:
            return data
        most = getattr(getattr(tenant, "limits", None), "max_tokens", None)
        value = GenerationRequest.model_fields["max_tokens"].default if default is None else default
        return {**data, "max_tokens": min(value, most) if isinstance(most, int) else value}

    async def _prepare(self, data: Mapping[str, Any], metadata: Mapping[str, str],
                       default_max_tokens: int | None = None) -> tuple[xpb.DraftJob, str, Any]:
        """Validate, tokenize, admit (tenancy) and build the draft job; returns the admission too.

        The one admission path of both APIs: gRPC passes ``convert.request_to_dict(proto)`` and
        its metadata, HTTP (:mod:`deployments.openai_api`) the dict it translated from the
        OpenAI body and its headers as metadata. The caller must end the admission with
        ``self.gate.complete`` (done by :meth:`generate_stream`).

        Raises:
            InvalidRequestError, AuthenticationError, ResourceExhaustedError, ModelNotReadyError.
        """
        named_proposer = (data.get("speculation") or {}).get("proposer")
        tenant = self.gate.authenticate_caller(  # before any work on the prompt
            metadata, named_proposer if isinstance(named_proposer, str) else "unknown")
        check_session_id(metadata)
        self._refuse_too_many_messages(data)
        data = self._default_max_tokens(data, tenant, default_max_tokens)
        req = parse_request(dict(data), convert.PROTO_FIELD_NAMES)  # fields named as the caller sent them
        proposer, k = self._hints(data)
        spec_given = data.get("speculation") or {}
        spec_update: dict = {"proposer": proposer, "k": k}
        if spec_given.get("draft_min_confidence") is None:
            spec_update["draft_min_confidence"] = self.cfg.draft_min_confidence
        req = req.model_copy(update={"speculation": req.speculation.model_copy(update=spec_update)})
        self._refuse_surely_too_long(req)
        # tokenizing a long prompt takes a while: off the event loop, so other requests go on
        prompt = await asyncio.get_running_loop().run_in_executor(self.encode_executor, self._encode, req)
        deadline = self._deadline(metadata)
        named = spec_given.get("proposer") is not None
        adm = await self.gate.admit(metadata, req, prompt_tokens=len(prompt),
                                    default_proposers=None if named else self._default_proposers(),
                                    tenant=tenant, timeout_s=max(0.0, deadline - time.time()),
                                    batch_k=self.cfg.served_batch_k)
        try:
            await self._ensure_ready()
            generation_id = uuid.uuid4().hex
            routing_key = metadata.get(SESSION_KEY) or generation_id
            job = self._job(adm.request, adm, prompt, f"{routing_key}/{generation_id}", deadline)
        except BaseException as e:
            await finish_despite_cancellation(self.gate.complete(adm, e))
            raise
        return job, routing_key, adm

    async def generate_stream(self, data: Mapping[str, Any], metadata: Mapping[str, str],
                              default_max_tokens: int | None = None) -> AsyncIterator[pb.GenerateStreamChunk]:
        """One generation, admitted and relayed: the shared code path of the gRPC and HTTP APIs.

        Args:
            data: the request as the plain dict :func:`specdec.request.parse_request` validates
                (only the fields the caller set).
            metadata: lower-case keys: ``authorization`` (``Bearer <key>``), optionally
                ``session_id`` and ``specdec-timeout-s``.
            default_max_tokens: ``max_tokens`` when ``data`` has none (None: the server's
                default), clipped to the tenant's limit (the OpenAI API's completions: 16).

        Yields:
            ``GenerateStreamChunk`` protos; the last carries finish reason, usage and stats.

        Raises:
            the specdec errors of :meth:`_prepare`, and DeadlineExceededError /
            ModelNotReadyError while relaying. The admission is completed however it ends
            (also when the caller stops iterating: the draft's stream is cancelled and both
            caches are freed).
        """
        job, key, adm = await self._prepare(data, metadata, default_max_tokens)
        t0 = time.perf_counter()
        ttft = last_at = None
        n_tokens = 0
        outcome: Any = None
        costs = None
        chunks: list[pb.GenerateStreamChunk] = []
        try:
            async for chunk in self._relay(job, key):
                if chunk.token_ids:
                    last_at = time.perf_counter()
                    if ttft is None:
                        ttft = last_at - t0
                    n_tokens += len(chunk.token_ids)
                chunks.append(chunk)
                yield chunk
            joined = convert.join_chunks(chunks)
            outcome = convert.result_from_proto(joined)
            costs = convert.step_costs_from_proto(joined.stats)  # per-step costs from the draft replica
        except BaseException as e:
            outcome = unwrap(e) if isinstance(e, Exception) else e
            raise
        finally:
            itl = (last_at - t0 - ttft) / (n_tokens - 1) if ttft is not None and n_tokens > 1 else None
            await finish_despite_cancellation(
                self.gate.complete(adm, outcome, ttft_s=ttft, inter_token_s=itl, costs=costs)
            )

    # --- relaying the draft's stream ---------------------------------------------------------

    async def _relay(self, job: xpb.DraftJob, routing_key: str) -> AsyncIterator[pb.GenerateStreamChunk]:
        """Stream ``job``'s chunks from the draft deployment, resuming after a replica death."""
        progress = RelayProgress()
        resumes = 0
        while True:
            progress.fill(job)
            stream = self.draft.options(session_id=routing_key, stream=True).Generate.remote(job.SerializeToString())
            finished = False
            try:
                chunks = stream.__aiter__()
                while True:
                    try:  # the deadline is kept here too: a step (a long prefill, a loaded CPU) can
                        # outlast it, and the draft replica checks it only between steps
                        raw = await asyncio.wait_for(chunks.__anext__(), _remaining(job.deadline_unix_s))
                    except StopAsyncIteration:
                        break
                    except (asyncio.TimeoutError, TimeoutError):
                        raise DeadlineExceededError("the request's deadline passed during generation") from None
                    chunk = progress.see(raw)
                    finished = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    yield chunk
                if not finished:
                    raise ModelNotReadyError("the draft replica ended the stream without a final chunk")
                return
            except Exception as e:
                if not is_replica_death(e) or resumes >= MAX_RESUMES:
                    raise
                if job.deadline_unix_s and time.time() > job.deadline_unix_s:
                    raise DeadlineExceededError("the request's deadline passed") from None
                resumes += 1
                self.resumes += 1
                log.warning("draft replica died during %s after %d tokens (%s); resuming (%d)",
                            job.session_id, len(progress.sent_ids), type(e).__name__, resumes)
                await asyncio.sleep(0.2 * resumes)
            finally:
                if not finished:
                    try:
                        stream.cancel()
                    except Exception:
                        pass

    # --- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        """Unary generation: the joined stream of the draft replica."""
        try:
            metadata = metadata_dict(grpc_context)
            check_application(metadata, self.cfg.app_name)
            _refuse_undecodable(request)
            data = convert.request_to_dict(request)
            chunks = [c async for c in self.generate_stream(data, metadata)]
            return convert.join_chunks(chunks)
        except Exception as e:  # mapped at the edge, never raised into Serve
            return abort_with(grpc_context, unwrap(e), pb.GenerateResponse)

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        """Server-streaming generation; the last chunk carries finish reason, usage and stats."""
        try:
            metadata = metadata_dict(grpc_context)
            check_application(metadata, self.cfg.app_name)
            _refuse_undecodable(request)
            data = convert.request_to_dict(request)
            async for chunk in self.generate_stream(data, metadata):
                yield chunk
        except Exception as e:
            abort_stream(grpc_context, unwrap(e))

    async def GetTenantStats(self, request: pb.GetTenantStatsRequest, grpc_context=None) -> pb.GetTenantStatsResponse:
        """The calling tenant's own statistics: acceptance rate, current K, cost terms, usage.

        The tenant comes from the API key, so a tenant can never read another's.
        """
        from deployments.batch_k_stats import fill_batch_load, merge_views
        from deployments.tenancy import proposer_name, tenant_stats_to_proto, uses_batch_k

        try:
            check_application(metadata_dict(grpc_context), self.cfg.app_name)
            _refuse_undecodable(request)
            stats = await self.gate.tenant_stats(metadata_dict(grpc_context))
            proposer = proposer_name(request.proposer)
            if proposer is None and request.proposer != pb.PROPOSER_UNSPECIFIED:
                raise InvalidRequestError(
                    "invalid request: proposer: Input should be PROPOSER_DRAFT, PROPOSER_NGRAM, PROPOSER_NONE or "
                    f"unset, got {request.proposer}")
            msg = tenant_stats_to_proto(stats, proposer)
        except Exception as e:
            return abort_with(grpc_context, unwrap(e), pb.GetTenantStatsResponse)
        try:  # the batch shape the target sees (best effort: stats must not fail on it)
            load = await asyncio.wait_for(self.target.BatchStats.remote(), timeout=5)
            msg.batch.forwards = int(load["forwards"])
            msg.batch.mean_rows = float(load["mean_rows"])
            msg.batch.mean_positions = float(load["mean_positions"])
            msg.batch.max_rows = int(load["max_rows"])
        except Exception:
            log.debug("target BatchStats unavailable", exc_info=True)
        # K under load for this tenant: the answering draft replica's, and every replica's as
        # of its last exchange with the shared controller (deployments.batch_k_stats)
        mine = None
        try:
            mine = await asyncio.wait_for(self.draft.BatchKStats.remote(stats["tenant_id"]), timeout=5)
        except Exception:
            log.debug("draft BatchKStats unavailable", exc_info=True)
        try:
            fill_batch_load(msg.batch, merge_views(stats.get("batch_replicas") or [], mine), time.time())
            if uses_batch_k(stats, proposer) and msg.batch.HasField("k_under_load"):
                msg.current_k = msg.batch.k_under_load  # its K is the draft replicas', one place
        except Exception:
            log.exception("K under load views")
        return msg

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP API of this replica (Serve calls it once, after __init__)."""
        from deployments.openai_api import build_app

        return build_app(self)

    async def Debug(self) -> dict:
        """Router counters (for tests): resumes after draft replica deaths."""
        return {"resumes": self.resumes, "ready": self._ready}
