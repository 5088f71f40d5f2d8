"""Every error in OpenAI's shape, and the routes that are not a generation (model listing).

    install(gateway, app)                        # GET /v1/models/{id}; 404 / 405 / 400 handlers
    uvicorn.Config(app, http=http_protocol())    # uvicorn's own 400 (a malformed HTTP request) as JSON too

Every answer that is not a success is `{"error": {"message", "type", "code", "param"}}` (OpenAI's
shape): an unknown route (404, naming the method and path; FastAPI's own /openapi.json, /docs and /redoc
are off, so they are 404s too), a wrong method (405, with `Allow`), FastAPI's request validation (400, not
422), and the bytes uvicorn writes itself when a request is not valid HTTP (400).
"""

from __future__ import annotations

import json

from SimpleTorchLLMRL.gateway.request import RequestError

ROUTES = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/responses/{id}, "
          "GET /v1/models, GET /v1/models/{model}, GET /health")
# OpenAI's error `type` per status; any other 4xx is an invalid request, any 5xx a server error
TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
         429: "rate_limit_error"}


def http_error(status: int, message: str, code: str | None = None, param: str | None = None) -> RequestError:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return RequestError(status, message, kind, code, param)


def model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "SimpleTorchLLMRL"}


def install(gateway, app) -> None:
    """Add the model routes and the error handlers to `app` (the gateway's FastAPI app)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    error = gateway.error

    @app.exception_handler(HTTPException)
    async def http_exception(request, exc: HTTPException):
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            e = http_error(404, f"Invalid URL ({method} {path}): this gateway serves {ROUTES}", "unknown_url")
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
        return model_object(gateway.model_name)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object(gateway.model_name)]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):  # the server keeps serving
        return error(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


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
