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

0. (gRPC) ``check_application``: ``application`` metadata naming another Serve application is
   NOT_FOUND (Serve's proxy hands any name to its only application);
1. ``TenancyGate.authenticate_caller``: the API key (UNAUTHENTICATED / HTTP 401), before any
   other work, so an unauthenticated caller cannot make the router validate or tokenize a
   large prompt; then the session id's length and the number of chat messages
   (:mod:`deployments.ingress.checks`, INVALID_ARGUMENT);
2. ``parse_request``: dict -> validated core request (INVALID_ARGUMENT / HTTP 400), the same
   messages on both APIs;
3. ``_hints``: the request's proposer and largest K, capped by ``default_max_k``;
4. ``_encode``: tokenize (chat template of the target) and check the context limit
   (INVALID_ARGUMENT for an empty or over-long prompt, or a prompt plus the ``max_tokens`` the
   caller set over the context: OpenAI's ``context_length_exceeded``; a request without
   ``max_tokens`` generates up to the context);
5. ``TenancyGate.admit`` (:mod:`deployments.tenancy`) for the authenticated tenant: its policy
   (INVALID_ARGUMENT, or K clipped), its limits (RESOURCE_EXHAUSTED; the rate lease lives as
   long as the request's own timeout), a fair admission slot, and the K of the shared per-tenant
   controller (K = 0: plain decoding);
6. ``_ensure_ready``: the models are loaded (else UNAVAILABLE within ``ready_timeout_s``);
7. ``_relay`` (:mod:`deployments.ingress.relay`): one ``DraftJob`` to the Draft deployment (sticky on the session id), whose
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

Shutting down (``specdec serve`` on Ctrl-C or SIGTERM, before it stops Serve, whose proxies
would cut every open connection at once): :meth:`Router.Drain` refuses new requests with
UNAVAILABLE (HTTP 503), lets the generations in flight finish for a grace period, then ends the
rest with UNAVAILABLE "the server is shutting down" (a ``data: {"error": ...}`` event on an HTTP
stream that already sent tokens), cancelling their draft streams (both caches freed).

Every admitted request ends with ``TenancyGate.complete`` (success, error or cancellation): the
fair slot and rate lease are released, the controller learns from the request's speculation
counters, and the metrics are recorded. A generation whose final chunk (finish reason, usage)
was relayed is complete (OK, its tokens counted and charged) whatever its consumer does next:
an HTTP response whose whole output came in one chunk stops iterating at once, a gRPC client
may go away after the last chunk; only one that ends before it is an error or CANCELLED. The
relay ends at the final chunk (a unary response is answered then), not when the draft replica's
stream ends after its cleanup: the rest of that stream is read apart
(:func:`deployments.ingress.relay.relay`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Mapping, Sequence

from deployments import convert
from deployments.aio import finish_despite_cancellation
from deployments.config import AppConfig
from deployments.grpc_status import abort_stream, abort_with
from deployments.ingress.checks import (  # noqa: F401 (PromptTooManyCharactersError, metadata_dict: re-exported)
    PromptTooManyCharactersError,
    check_application,
    check_session_id,
    deadline_from_metadata,
    metadata_dict,
    refuse_surely_too_long,
    refuse_too_many_messages,
    refuse_undecodable,
    with_default_max_tokens,
)
from deployments.ingress.relay import MAX_RESUMES, SHUTTING_DOWN, RelayProgress, relay  # noqa: F401 (re-exported)
from deployments.metadata import SESSION_KEY, TIMEOUT_KEY  # noqa: F401 (TIMEOUT_KEY: re-exported)
from deployments.ray_errors import unwrap
from protos.specdec.v1 import exchange_pb2 as xpb
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import InvalidRequestError, ModelNotReadyError
from specdec.request import MAX_SPECULATION_LENGTH, GenerationRequest, parse_request

log = logging.getLogger(__name__)


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
        # without torch (read in a child process): this replica holds no model
        self.info = info if info is not None else TargetInfo.load_served(cfg)
        self.gate = gate if gate is not None else TenancyGate.from_config(cfg)
        self._ready = False
        self._settled = False  # the draft replica's start-up calibration has ended (GET /health)
        self.resumes = 0
        #: tokenizes prompts off the event loop: one thread per request the replica may run at
        #: once (Serve's max_ongoing_requests), not the loop's default pool sized by the host's cores
        self.encode_executor = ThreadPoolExecutor(max_workers=cfg.router.max_ongoing_requests,
                                                  thread_name_prefix="specdec-tokenize")
        #: longest vocabulary entry, in characters: a text of n characters is at least
        #: n / this many tokens (byte-level and SentencePiece vocabularies spell every decoded
        #: character with at least one character of the entry)
        self._max_token_chars = max((len(t) for t in self.info.tokenizer.get_vocab()), default=1) or 1
        #: generations of this replica from their first step (validation) to their end
        self.in_flight = 0
        #: shutting down (:meth:`Drain`): new requests are refused with UNAVAILABLE
        self.draining = False
        #: the generations in flight are cut (:meth:`Drain`); each has its own stop event,
        #: made in its own event loop (an asyncio.Event binds to the first loop that waits on it)
        self.cut = False
        self._stops: set[asyncio.Event] = set()
        self._drain_task: asyncio.Task | None = None

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

    def _encode(self, req: GenerationRequest, max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids, refused when it does not fit the target's context with
        ``max_tokens`` (the caller's own; None when it left it out: then up to the context).

        Raises:
            InvalidRequestError, PromptTooLongError, ContextLengthExceededError
            (:func:`specdec.engine.prompt.check_context_length`).
        """
        from specdec.engine.prompt import check_context_length, encode_prompt, prompt_name

        ids = encode_prompt(self.info.tokenizer, req, self.info.emittable_vocab)
        check_context_length(len(ids), max_tokens, self.info.max_positions, f"the target '{self.info.name}'",
                             prompt_name(req))
        return ids

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

    async def _ensure_settled(self) -> None:
        """:meth:`_ensure_ready`, and the draft replica's start-up calibration has ended
        (``Draft.Settled``; the readiness ``GET /health`` reports). Raises ModelNotReadyError
        ("still calibrating") when it has not within ``ready_timeout_s``."""
        await self._ensure_ready()
        if self._settled or self.draft is None:
            return
        try:
            await asyncio.wait_for(self.draft.Settled.remote(), timeout=self.cfg.ready_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise ModelNotReadyError("the draft replica is still calibrating its cost model; retry in a few seconds") from None
        except Exception as e:
            raise ModelNotReadyError(f"the models are not available: {unwrap(e)}") from None
        self._settled = True

    async def Settled(self) -> bool:
        """Whether ``GET /health`` would answer 200 now (:meth:`_ensure_settled`: the models
        answer and the draft replica's start-up calibration has ended), as a bool: what the
        gRPC health servicer in Serve's proxy reports for ``specdec.v1.SpecDec``
        (:func:`deployments.health.serve_apps_settled`). Waits at most twice ``ready_timeout_s``."""
        try:
            await self._ensure_settled()
        except ModelNotReadyError:
            return False
        return True

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
        if self.draining:
            raise ModelNotReadyError(SHUTTING_DOWN)
        named_proposer = (data.get("speculation") or {}).get("proposer")
        tenant = self.gate.authenticate_caller(  # before any work on the prompt
            metadata, named_proposer if isinstance(named_proposer, str) else "unknown")
        check_session_id(metadata)
        refuse_too_many_messages(data, self.cfg.max_chat_messages)
        # only a max_tokens the caller set must fit beside the prompt; a default one does not
        # (the generation then stops at the context, as OpenAI's API without max_tokens)
        explicit_max_tokens = data.get("max_tokens") is not None
        data = with_default_max_tokens(data, tenant, default_max_tokens)
        req = parse_request(dict(data), convert.PROTO_FIELD_NAMES)  # fields named as the caller sent them
        proposer, k = self._hints(data)
        spec_given = data.get("speculation") or {}
        spec_update: dict = {"proposer": proposer, "k": k}
        if spec_given.get("draft_min_confidence") is None:
            spec_update["draft_min_confidence"] = self.cfg.draft_min_confidence
        req = req.model_copy(update={"speculation": req.speculation.model_copy(update=spec_update)})
        refuse_surely_too_long(req, self.info.max_positions, self._max_token_chars, self.info.name)
        # tokenizing a long prompt takes a while: off the event loop, so other requests go on
        prompt = await asyncio.get_running_loop().run_in_executor(
            self.encode_executor, self._encode, req, req.max_tokens if explicit_max_tokens else None)
        deadline = deadline_from_metadata(metadata, self.cfg.request_timeout_s)
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
            ModelNotReadyError while relaying. The admission is completed however it ends:
            with the generation's result once its final chunk was yielded (also when the
            caller then stops iterating or is cancelled), else with the error or cancellation
            that ended it (when the caller stops iterating before the final chunk, the draft's
            stream is cancelled and both caches are freed).
        """
        self.in_flight += 1  # counted from validation on, so Drain waits for admissions too
        try:
            job, key, adm = await self._prepare(data, metadata, default_max_tokens)
        except BaseException:
            self.in_flight -= 1
            raise
        t0 = time.perf_counter()
        ttft = last_at = None
        n_tokens = 0
        outcome: Any = None
        costs = None
        chunks: list[pb.GenerateStreamChunk] = []
        stop = asyncio.Event()  # set by Drain to cut this generation
        if self.cut:
            stop.set()
        self._stops.add(stop)
        stream = self._relay(job, key, stop)
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    last_at = time.perf_counter()
                    if ttft is None:
                        ttft = last_at - t0
                    n_tokens += len(chunk.token_ids)
                chunks.append(chunk)
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    # the final chunk (finish reason, usage): the generation is complete before
                    # it is handed on, whatever the consumer does next (an HTTP response whose
                    # last chunk came stops iterating: GeneratorExit or a cancellation here)
                    joined = convert.join_chunks(chunks)
                    outcome = convert.result_from_proto(joined)
                    costs = convert.step_costs_from_proto(joined.stats)  # per-step costs from the draft replica
                yield chunk
            if outcome is None:  # the relay ends only after a final chunk; never without one
                raise ModelNotReadyError("the draft replica ended the stream without a final chunk")
        except BaseException as e:
            if outcome is None:  # ended before its final chunk: an error or a cancellation
                outcome = unwrap(e) if isinstance(e, Exception) else e
            raise
        finally:
            self.in_flight -= 1
            self._stops.discard(stop)
            itl = (last_at - t0 - ttft) / (n_tokens - 1) if ttft is not None and n_tokens > 1 else None
            # one cleanup, its only await: a second cancellation (Serve may send two) ends the
            # wait on it, so nothing after a first await of this block would run
            await finish_despite_cancellation(
                self._end(stream, adm, outcome, ttft_s=ttft, inter_token_s=itl, costs=costs))

    async def _end(self, stream: Any, adm: Any, outcome: Any, **measured: Any) -> None:
        """Close the relay (now, not by the garbage collector: a draft stream left mid-generation
        is cancelled, both caches freed), then complete the admission with ``outcome``."""
        try:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        except Exception:  # noqa: BLE001 - closing never decides the outcome
            log.warning("closing the relay of a generation failed", exc_info=True)
        finally:
            await self.gate.complete(adm, outcome, **measured)

    # --- relaying the draft's stream ---------------------------------------------------------

    def _relay(self, job: xpb.DraftJob, routing_key: str,
               stop: asyncio.Event | None = None) -> AsyncIterator[pb.GenerateStreamChunk]:
        """Stream ``job``'s chunks from the draft deployment, resuming after a replica death
        (:func:`deployments.ingress.relay.relay`; resumes are counted in ``self.resumes``), until
        ``stop`` is set (:meth:`Drain`)."""
        return relay(self.draft, job, routing_key, self._count_resume, stop=stop)

    async def Drain(self, grace_s: float = 3.0) -> dict:
        """Shut this replica's generations down, once (later calls wait for the first's end).

        New requests get UNAVAILABLE at once; the generations in flight may finish within
        ``grace_s`` seconds; those still running then end with UNAVAILABLE (:data:`SHUTTING_DOWN`;
        their draft streams are cancelled, both caches freed). Waits until they have ended (at
        most 2 s more). ``specdec serve`` calls it before stopping Serve, whose proxies would cut
        every open connection without a status.

        Args:
            grace_s: seconds the generations in flight have to finish (0: cut them at once).

        Returns:
            ``{"replica": id, "in_flight": generations when the drain began, "cut": generations
            still running after grace_s, "left": generations still running at the end}``.
        """
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain(max(0.0, float(grace_s))))
        return await asyncio.shield(self._drain_task)

    async def _drain(self, grace_s: float) -> dict:
        self.draining = True
        began = self.in_flight
        end = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        cut = self.in_flight
        self.cut = True
        for stop in list(self._stops):
            stop.set()
        end = time.monotonic() + 2.0
        while self.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if cut:
            log.warning("shutting down: %d of %d generations in flight cut after %.1f s (UNAVAILABLE)",
                        cut, began, grace_s)
        return {"replica": _replica_id(), "in_flight": began, "cut": cut, "left": self.in_flight}

    def _count_resume(self) -> None:
        self.resumes += 1

    # --- RPCs ----------------------------------------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        """Unary generation: the joined stream of the draft replica."""
        try:
            metadata = metadata_dict(grpc_context)
            check_application(metadata, self.cfg.app_name)
            refuse_undecodable(request)
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
            refuse_undecodable(request)
            data = convert.request_to_dict(request)
            async for chunk in self.generate_stream(data, metadata):
                yield chunk
        except Exception as e:
            abort_stream(grpc_context, unwrap(e))

    async def GetTenantStats(self, request: pb.GetTenantStatsRequest, grpc_context=None) -> pb.GetTenantStatsResponse:
        """The calling tenant's own statistics: acceptance rate, current K, cost terms, usage.

        The tenant comes from the API key, so a tenant can never read another's. A proposer
        this server does not run, or the tenant may not use, is INVALID_ARGUMENT with the
        message ``Generate`` gives a request naming it.
        """
        from deployments.ingress.tenant_stats import add_batch_load, proposer_name, tenant_stats_to_proto

        try:
            check_application(metadata_dict(grpc_context), self.cfg.app_name)
            refuse_undecodable(request)
            self.gate.authenticate(metadata_dict(grpc_context))  # UNAUTHENTICATED before any other answer
            proposer = proposer_name(request.proposer)
            if proposer is None and request.proposer != pb.PROPOSER_UNSPECIFIED:
                raise InvalidRequestError(
                    "invalid request: proposer: Input should be PROPOSER_DRAFT, PROPOSER_NGRAM, PROPOSER_NONE or "
                    f"unset, got {request.proposer}")
            if proposer is not None:
                self._hints({"speculation": {"proposer": proposer}})  # 'draft' without a draft model, as Generate
            stats = await self.gate.tenant_stats(metadata_dict(grpc_context), proposer)
            msg = tenant_stats_to_proto(stats, proposer)
        except Exception as e:
            return abort_with(grpc_context, unwrap(e), pb.GetTenantStatsResponse)
        await add_batch_load(msg, stats, proposer, self.target, self.draft)
        return msg

    def __serve_build_asgi_app__(self):
        """The OpenAI-compatible HTTP API of this replica (Serve calls it once, after __init__)."""
        from deployments.openai_api import build_app

        return build_app(self)

    async def Debug(self) -> dict:
        """Router counters (for tests): resumes after draft replica deaths."""
        return {"resumes": self.resumes, "ready": self._ready}


def _replica_id() -> str:
    """This Serve replica's unique id ("local" outside a replica, as in the in-process tests)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return "local"
