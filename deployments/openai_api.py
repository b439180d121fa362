"""The OpenAI-compatible HTTP API, served by the Router beside the gRPC API.

    GET  /specdec/                      a short JSON description of the endpoints
    GET  /specdec/v1/models             the served model id(s)
    POST /specdec/v1/completions        text completion (prompt: a string or token ids)
    POST /specdec/v1/chat/completions   chat completion (the target's chat template)

(``/specdec`` is the Serve application's route prefix, ``AppConfig.app_name``; an OpenAI client
uses ``base_url="http://HOST:8000/specdec/v1"``.)

This module is the FastAPI app of a Router replica (routes, error handlers);
:mod:`deployments.openai_choices` runs a request's ``n`` choices: to the end and joined
(unary), or merged into server-sent events as they come (streamed). What goes in and out is
translated elsewhere:
:mod:`deployments.openai_requests` turns a body into the core request dict (the field
mapping), :mod:`deployments.openai_responses` turns results into OpenAI's shapes and
:mod:`deployments.openai_errors` errors (and HTTP statuses).

Streaming (``stream: true``): server-sent events, ``data: {chunk}`` lines then ``data: [DONE]``;
with ``stream_options: {"include_usage": true}`` a last chunk with empty ``choices`` carries
``usage``. Errors found before the first token (all validation, tenancy, loading) answer with
their HTTP status; an error after the stream started is sent as ``data: {"error": ...}`` before
``[DONE]``. A client that disconnects cancels its generations: the draft and target caches are
freed and the tenant's slot and tokens returned.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request  # module level: route annotations are resolved from these globals

from deployments.openai_choices import run_unary, sse_events, start_choices
from deployments.openai_errors import error_body, error_response
from deployments.openai_requests import max_body_bytes, metadata_from_headers, read_body, translate
from deployments.openai_responses import TokenText, unary_response
from specdec.errors import InvalidRequestError, ModelNotFoundError


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
                "GET /health": "whether the models are loaded and the start-up calibration has ended",
            },
            "grpc": {"service": "specdec.v1.SpecDec", "port": router.cfg.grpc_port,
                     "metadata": {"application": router.cfg.app_name}},
            "auth": "Authorization: Bearer <key>" if not router.gate.open_mode else "none (open mode)",
        }

    @app.get("/health")
    async def health():
        try:
            await router._ensure_settled()
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
        body = None
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
            return error_response(unwrap(e), endpoint, body)
        return StreamingResponse(sse_events(req, started, text), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    return app
