"""The routes: each generation route's two ends (`Route`, `routes()`), the routes that are not a generation
(models, sessions), and every error in OpenAI's shape, uvicorn's own 400 too (docs/gateway.md, "The API").
"""

import json
from collections.abc import Callable
from dataclasses import dataclass

from SimpleTorchLLMRL.gateway.request import RequestError

ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/responses/{id}, "
          "POST /inference/v1/generate, GET /v1/models, GET /v1/models/{model}, GET /health")
ADMIN_ROUTES = "GET /v1/sessions, POST /v1/sessions/{id}/finish"
# OpenAI's error `type` per status; any other 4xx is an invalid request, any 5xx a server error
TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
         429: "rate_limit_error"}


@dataclass(frozen=True)
class Route:
    """A generation route's two ends. parse(body, gateway) -> GenRequest; render(result, req, gateway) -> a
    JSON-ready dict (or a response); stream(started, events, req, gateway) -> the streaming response of a live
    stream (None: the route renders streams itself); respell(RequestError) -> the error as the route names
    its fields; longest: the most items a top-level list field may hold (refused before the rest of a large
    body is decoded)."""

    path: str
    parse: Callable
    render: Callable
    stream: Callable | None = None
    respell: Callable | None = None
    longest: dict[str, int] | None = None  # top-level list fields' limits, checked while a large body is read


def routes() -> list[Route]:
    """Every generation route: a new one is its parse and render functions added here."""
    import SimpleTorchLLMRL.gateway.chat as chat
    import SimpleTorchLLMRL.gateway.completions as completions
    import SimpleTorchLLMRL.gateway.responses_route as responses_route
    import SimpleTorchLLMRL.gateway.tokens as tokens
    from SimpleTorchLLMRL.gateway.streaming import chat_stream

    tools = {"tools": chat.MAX_TOOLS}
    return [Route("/v1/chat/completions", chat.parse, chat.render, chat_stream, longest=tools),
            Route("/v1/completions", completions.parse, completions.render),
            Route("/v1/responses", responses_route.parse, responses_route.render, responses_route.stream,
                  responses_route.respell, longest=tools),
            Route("/inference/v1/generate", tokens.parse, tokens.render)]


def http_error(status: int, message: str, code: str | None = None, param: str | None = None) -> RequestError:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return RequestError(status, message, kind, code, param)


def model_object(name: str, max_model_len: int | None = None) -> dict:
    """OpenAI's model object, with vLLM's `max_model_len` (the context, in tokens) when it is known."""
    out = {"id": name, "object": "model", "created": 0, "owned_by": "SimpleTorchLLMRL"}
    return out if max_model_len is None else {**out, "max_model_len": max_model_len}


def install(gateway, app) -> None:
    """Add the model routes and the error handlers to `app` (the gateway's FastAPI app)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    error = gateway.error

    @app.exception_handler(HTTPException)
    async def http_exception(request, exc: HTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            served = ROUTES if gateway.admin_key is None else f"{ROUTES}, {ADMIN_ROUTES}"
            e = http_error(404, f"Invalid URL ({method} {path}): this gateway serves {served}", "unknown_url")
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow") or ""
            e = http_error(405, f"Method {method} is not allowed on {path}" + (f"; use {allow}" if allow else ""),
                           "method_not_allowed")
        else:
            e = http_error(exc.status_code, str(exc.detail))
        response = error(e)
        for key, value in (exc.headers or {}).items():  # Allow on 405, WWW-Authenticate, ...
            response.headers[key] = value
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):  # FastAPI's 422: OpenAI answers 400
        problems = exc.errors()
        where = [".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header"))
                 for err in problems]
        message = "; ".join(f"{w or 'body'}: {err.get('msg', 'invalid')}" for w, err in zip(where, problems,
                                                                                             strict=True))
        return error(http_error(400, message or "invalid request", param=(where[0] or None) if where else None))

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != gateway.model_name:
            return error(http_error(404, f"The model '{model}' does not exist; this gateway serves "
                                         f"'{gateway.model_name}'", "model_not_found", "model"))
        return model_object(gateway.model_name, gateway.max_context)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object(gateway.model_name, gateway.max_context)]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):  # the server keeps serving
        return error(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def install_admin(gateway, app) -> None:
    """The session routes of a trainer in another process, each answered only to `Authorization: Bearer
    <gateway.admin_key>` (401 otherwise): GET /v1/sessions (each open session's size) and POST
    /v1/sessions/{id}/finish (`Gateway.take` of one: its rollouts as the records rollout files hold; 404 for an
    unknown id, 409 while a call of it is in flight)."""
    import asyncio
    import hmac

    from fastapi import Request
    from fastapi.responses import JSONResponse

    from SimpleTorchLLMRL.chat.message import rollout_to_dict

    expected = f"Bearer {gateway.admin_key}".encode()

    def refused(request: Request):
        given = (request.headers.get("authorization") or "").strip().encode("utf-8", "replace")
        if hmac.compare_digest(given, expected):
            return None
        response = gateway.error(http_error(401, "the session routes need this gateway's admin key: "
                                                 "`Authorization: Bearer <admin key>`", "invalid_api_key"))
        response.headers["www-authenticate"] = "Bearer"
        return response

    @app.get("/v1/sessions")
    async def sessions(request: Request):
        return refused(request) or {"object": "list", "data": gateway.store.sizes()}

    @app.post("/v1/sessions/{session_id:path}/finish")
    async def finish(session_id: str, request: Request):
        if (no := refused(request)) is not None:
            return no
        try:
            rollouts = (await asyncio.to_thread(gateway.take, [session_id]))[session_id]
        except ValueError as e:
            return gateway.error(http_error(409, str(e), "session_busy"))
        if not rollouts:
            return gateway.error(http_error(404, f"no session {session_id!r}; GET /v1/sessions lists the open ones",
                                            "session_not_found"))
        records = await asyncio.to_thread(lambda: [rollout_to_dict(r) for r in rollouts])
        return JSONResponse({"object": "list", "session": session_id, "data": records})


# ----------------------------------------------------------------------------- uvicorn's own answers


def error_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body, closing the connection."""
    body = json.dumps(http_error(status, message).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
    return head + body


def http_protocol():
    """uvicorn's HTTP protocol class (httptools, else h11) answering a request that is not valid HTTP with an
    OpenAI-shaped 400 instead of plain text. (uvicorn's other answers of its own, a 503 under
    `limit_concurrency` and a 500 when the app sends nothing, cannot happen here: no concurrency limit is
    set and every exception the app raises is answered by its handler.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class OpenAIErrorsProtocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            self.transport.write(error_bytes(400, "Bad Request", msg))
            self.transport.close()

    return OpenAIErrorsProtocol
