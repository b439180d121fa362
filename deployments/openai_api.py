"""The OpenAI-compatible HTTP API, served by the Router beside the gRPC API.

    GET  /specdec/                      a short JSON description of the endpoints
    GET  /specdec/v1/models             the served model id(s)
    POST /specdec/v1/completions        text completion (prompt: a string or token ids)
    POST /specdec/v1/chat/completions   chat completion (the target's chat template)

(``/specdec`` is the Serve application's route prefix, ``AppConfig.app_name``; an OpenAI client
uses ``base_url="http://HOST:8000/specdec/v1"``.)

This module is the FastAPI app of a Router replica (routes, error handlers) and runs a
request's ``n`` choices: to the end and joined (unary), or merged into server-sent events as
they come (streamed). What goes in and out is translated elsewhere:
:mod:`deployments.openai_requests` turns a body into the core request dict (the field
mapping), :mod:`deployments.openai_responses` turns results and errors into OpenAI's shapes
(and HTTP statuses).

Streaming (``stream: true``): server-sent events, ``data: {chunk}`` lines then ``data: [DONE]``;
with ``stream_options: {"include_usage": true}`` a last chunk with empty ``choices`` carries
``usage``. Errors found before the first token (all validation, tenancy, loading) answer with
their HTTP status; an error after the stream started is sent as ``data: {"error": ...}`` before
``[DONE]``. A client that disconnects cancels its generations: the draft and target caches are
freed and the tenant's slot and tokens returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator, Mapping

from fastapi import Request  # module level: route annotations are resolved from these globals

from deployments.aio import finish_despite_cancellation
from deployments.grpc_status import details_for
from deployments.openai_errors import error_body, error_code, error_param, error_response, http_status_for
from deployments.openai_requests import OpenAIRequest, max_body_bytes, metadata_from_headers, read_body, translate
from deployments.openai_responses import (
    SSE_DONE,
    TextOffsets,
    TokenText,
    chunk_envelope,
    pooled_stats,
    sse,
    stream_chunk,
    unary_response,
    usage_dict,
)
from protos.specdec.v1 import specdec_pb2 as pb
from specdec.errors import InvalidRequestError, ModelNotFoundError




# --- running the choices -------------------------------------------------------------------------


async def _close(gen: Any) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await finish_despite_cancellation(aclose())


def _own_serve_request_id() -> None:
    """Give the Serve handle calls of the current task (one choice) their own internal request id.

    Serve's request router indexes the calls that wait for a replica by the internal id of the
    request that makes them (Ray 2.60: ``RequestRouter._pending_requests_by_id``, keyed by
    ``RequestMetadata.internal_request_id``); the n choices of one HTTP request share their
    request's id, and when they wait together one of them can be left waiting for a replica
    forever (seen: n = 3 hung, one choice never reaching the draft replica). Only the context of
    this task changes (asyncio copies it per task); in process (no Serve request) nothing does.
    A client's disconnect still stops every choice: the request's task closes them.
    """
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id
    except ImportError:  # pragma: no cover - Serve is a dependency of deployments/
        return
    ctx = serve_context._serve_request_context.get()
    if ctx is None or not ctx._internal_request_id:
        return
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))


class DrainedChoice:
    """One choice's generation, read from the start by its own task into a queue.

    With ``n > 1`` every choice holds a router admission slot while it runs. Had a choice waited
    to be read (for the other choices' first chunks, or for the client), it would keep its slot
    while choices still queued for a slot wait on it: with fewer free slots than ``n`` the
    request never started. Drained, each choice runs to its end and frees its slot whatever the
    others and the client do; the chunks wait in memory (at most ``max_tokens`` per choice).

    Iterating gives the chunks, then the generation's error if it failed; :meth:`aclose`
    cancels the generation (its admission is ended, both caches freed).
    """

    _END = object()

    def __init__(self, gen: Any):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._drain(gen))

    async def _drain(self, gen: Any) -> None:
        _own_serve_request_id()
        try:
            async for c in gen:
                self.queue.put_nowait(c)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the reader
            self.queue.put_nowait(e)
        else:
            self.queue.put_nowait(self._END)
        finally:
            await _close(gen)

    def __aiter__(self) -> "DrainedChoice":
        return self

    async def __anext__(self) -> Any:
        item = await self.queue.get()
        if item is self._END:
            self.queue.put_nowait(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        self.task.cancel()
        await finish_despite_cancellation(asyncio.gather(self.task, return_exceptions=True))


def _refuse_n_over_the_tenants_concurrency(router: Any, n: int, metadata: Mapping[str, str]) -> None:
    """Each choice is admitted as one request: ``n`` above the caller's tenant limit
    ``max_concurrent_requests`` can never run, so it is refused as such (no ``Retry-After``;
    the message says to lower n), not with the retryable "already has k requests in flight".

    Raises:
        AuthenticationError: no, malformed or unknown key.
        ResourceExhaustedError: ``limit="max_concurrent_requests"``.
    """
    from specdec.errors import ResourceExhaustedError

    gate = getattr(router, "gate", None)
    if gate is None:
        return
    tenant = gate.authenticate_caller(metadata)
    most = tenant.limits.max_concurrent_requests
    if n > most:
        raise ResourceExhaustedError(
            f"n={n} choices run as {n} concurrent requests but tenant {tenant.id!r} may run at most {most} at once "
            "(limit max_concurrent_requests); lower n", limit="max_concurrent_requests")


async def start_choices(router: Any, req: OpenAIRequest, metadata: Mapping[str, str]) -> list[tuple[Any, Any]]:
    """Start the n generations and wait for each one's first chunk, so that every error found
    before generating (validation, tenancy, loading) is raised here, before any byte is sent.
    With ``n > 1`` each generation is a :class:`DrainedChoice` (no choice waits on another).

    Returns:
        ``[(first_chunk, stream), ...]`` per choice.

    Raises:
        the first choice's error (the others are cancelled and their admissions ended).
    """
    if req.n > 1:
        _refuse_n_over_the_tenants_concurrency(router, req.n, metadata)
    gens = [router.generate_stream(req.choice_data(i), metadata, req.default_max_tokens) for i in range(req.n)]
    if req.n > 1:
        gens = [DrainedChoice(g) for g in gens]
    firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
    try:
        await asyncio.gather(*firsts)
    except BaseException:
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for g in gens:
            await _close(g)
        # the first choice's own error where it has one (the same error as n = 1 would get)
        for f in firsts:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        raise
    return [(f.result(), g) for f, g in zip(firsts, gens)]


async def merged(started: list[tuple[Any, Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, chunk)`` from all choices as they come; the streams are closed (and
    their generations cancelled) when this generator is."""
    if len(started) == 1:
        first, gen = started[0]
        try:
            yield 0, first
            if first.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                async for c in gen:
                    yield 0, c
        finally:
            await _close(gen)
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, first: Any, gen: Any) -> None:
        try:
            await queue.put((i, first))
            if first.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
                async for c in gen:
                    await queue.put((i, c))
            await queue.put((i, done))
        except BaseException as e:
            await queue.put((i, e))
            raise
        finally:
            await _close(gen)

    tasks = [asyncio.ensure_future(pump(i, f, g)) for i, (f, g) in enumerate(started)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await finish_despite_cancellation(asyncio.gather(*tasks, return_exceptions=True))


async def run_unary(router: Any, req: OpenAIRequest, metadata: Mapping[str, str]) -> list[pb.GenerateResponse]:
    """Run all choices to the end; their joined results in choice order."""
    from deployments import convert

    started = await start_choices(router, req, metadata)
    chunks: list[list] = [[] for _ in started]
    async for i, c in merged(started):
        chunks[i].append(c)
    return [convert.join_chunks(cs) for cs in chunks]


async def sse_events(req: OpenAIRequest, started: list[tuple[Any, Any]], text: TokenText) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response."""
    offsets = [TextOffsets(text) for _ in started]
    firsts = [True] * len(started)
    finals: list = [None] * len(started)
    stream = merged(started)
    try:
        async for i, c in stream:
            yield sse(stream_chunk(req, i, c, text, offsets[i], firsts[i]))
            firsts[i] = False
            if c.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finals[i] = c
        if req.include_usage:
            last = chunk_envelope(req, [])
            last["usage"] = usage_dict(finals)
            last["speculation_stats"] = pooled_stats([f.stats for f in finals])
            yield sse(last)
    except Exception as e:  # after the first byte the status is sent: report in the stream
        from deployments.ray_errors import unwrap

        e = unwrap(e)
        yield sse(error_body(http_status_for(e), details_for(e), error_code(e), error_param(e, req.endpoint)))
    finally:
        await _close(stream)
    yield SSE_DONE


# --- the FastAPI app -----------------------------------------------------------------------------


def model_ids(cfg: Any) -> list[str]:
    """Model ids the HTTP API answers to: the application name (what ``/v1/models`` lists)."""
    return [cfg.app_name]


class _RootWithoutSlash:
    """ASGI middleware: the application's own prefix without a trailing slash (``GET /specdec``)
    is its root ``/`` (FastAPI would answer a 307 redirect to ``/specdec/``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        root = scope.get("root_path") or ""
        if scope.get("type") == "http" and root and scope.get("path") == root:
            scope = dict(scope, path=root + "/", raw_path=(root + "/").encode())
        await self.app(scope, receive, send)


def build_app(router: Any):
    """The FastAPI app of one Router replica (``Router.__serve_build_asgi_app__``).

    Args:
        router: the :class:`deployments.router.Router` whose :meth:`generate_stream`,
            ``gate`` and ``cfg`` the routes use.
    """
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from deployments.ray_errors import unwrap

    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_RootWithoutSlash)
    ids = model_ids(router.cfg)
    created = int(time.time())
    body_limit = max_body_bytes(router.info.max_positions, router._max_token_chars, router.info.vocab_rows)
    text = TokenText(router.info.tokenizer)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = (f"no such endpoint: {request.method} {request.url.path}; see GET {request.scope.get('root_path', '')}/ "
                   "for the endpoints")
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, msg), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception):
        return error_response(unwrap(exc))

    @app.get("/")
    async def describe(request: Request):
        base = request.scope.get("root_path", "")
        return {
            "service": "specdec: exact speculative decoding",
            "models": ids,
            "openai_base_url": f"{base}/v1",
            "endpoints": {
                "GET /v1/models": "the served model ids",
                "POST /v1/completions": "text completion (OpenAI; stream: true for server-sent events)",
                "POST /v1/chat/completions": "chat completion (OpenAI; stream: true for server-sent events)",
                "GET /health": "whether the models are loaded",
            },
            "grpc": {"service": "specdec.v1.SpecDec", "port": router.cfg.grpc_port,
                     "metadata": {"application": router.cfg.app_name}},
            "auth": "Authorization: Bearer <key>" if not router.gate.open_mode else "none (open mode)",
        }

    @app.get("/health")
    async def health():
        try:
            await router._ensure_ready()
        except Exception as e:
            return error_response(e)
        return {"status": "ok"}

    def _model(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "specdec",
                "root": router.info.name}

    @app.get("/v1/models")
    async def list_models(request: Request):
        try:
            router.gate.authenticate(metadata_from_headers(request.headers))
        except Exception as e:
            return error_response(e)
        return {"object": "list", "data": [_model(m) for m in ids]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        try:
            router.gate.authenticate(metadata_from_headers(request.headers))
            if model_id not in ids:
                raise ModelNotFoundError(f"the model '{model_id}' does not exist")
        except Exception as e:
            return error_response(e)
        return _model(model_id)

    async def _serve(request: Request, endpoint: str):
        try:
            metadata = metadata_from_headers(request.headers)
            # the key first, as gRPC's path: an unknown caller gets 401 whatever its body holds
            router.gate.authenticate_caller(metadata)
            raw = await read_body(request, body_limit)
            try:
                body = json.loads(raw)
            except ValueError:
                raise InvalidRequestError("the request body is not valid JSON") from None
            except RecursionError:  # json's decoder recurses per nesting level
                raise InvalidRequestError("the request body is JSON nested too deeply") from None
            req = translate(body, endpoint, ids)
            if not req.stream:
                results = await run_unary(router, req, metadata)
                return JSONResponse(unary_response(req, results, text))
            started = await start_choices(router, req, metadata)
        except Exception as e:
            return error_response(unwrap(e), endpoint)
        return StreamingResponse(sse_events(req, started, text), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    return app
