"""`Gateway`: an OpenAI-compatible chat endpoint over a `ModelGenerate` that records what it sampled.

    gw = Gateway(generator)                                  # HF or vLLM backend
    with gw.serve(host="127.0.0.1", port=0) as url:          # url: "http://127.0.0.1:PORT/v1"
        client = OpenAI(base_url=url, api_key="episode-17")   # the API key names the session
        ...                                                  # any agent written against the OpenAI API
    rollouts = gw.rollouts("episode-17")                     # list[Rollout], ready for GRPO

Routes: POST /v1/chat/completions, GET /v1/models, GET /health; POST /v1/completions, GET /v1/models/{id}
and OpenAI-shaped errors for everything else: `gateway.routes`; POST /v1/responses (the Responses API,
translated onto the chat path): `gateway.responses_route`. A session is named by the
`X-Session-Id` header, else by the API key (`Authorization: Bearer ...`). How calls of a
session become rollouts: `gateway.sessions`. Wire format: `gateway.openai_format`.
"""


import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence

from SimpleTorchLLMRL.chat.message import Message, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.gateway.batcher import Batcher, Job
from SimpleTorchLLMRL.gateway.limits import DEFAULT_MAX_BODY_BYTES, check_prompt_size, parse_json, read_body
from SimpleTorchLLMRL.gateway.openai_format import (
    ChatRequest,
    RequestError,
    bad,
    completion_payload,
    finish_reason,
    logprobs_payload,
    new_id,
    parse_request,
    reply_view,
    shown_text,
    top_logprobs,
)
from SimpleTorchLLMRL.gateway.routes import http_protocol
from SimpleTorchLLMRL.gateway.routes import install as install_routes
from SimpleTorchLLMRL.gateway.sessions import SessionStore, shown_view
from SimpleTorchLLMRL.gateway.streaming import (
    DONE,
    RESET,
    Finished,
    Listener,
    RowText,
    Started,
    TextDelta,
    chunk,
    head_chunks,
    next_ids,
    sse_stream,
    tail_chunks,
    tool_openings,
    until_disconnect,
)
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

ANONYMOUS = "default"


def _fastapi():
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise ImportError("the gateway needs FastAPI and uvicorn: pip install 'SimpleTorchLLMRL[gateway]'") from e
    return fastapi, uvicorn


def session_name(headers) -> str:
    """X-Session-Id, else the bearer API key, else "default"."""
    explicit = headers.get("x-session-id")
    if explicit:
        return explicit
    auth = headers.get("authorization") or ""
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return key or ANONYMOUS


class Gateway:
    """An OpenAI-compatible server over `generator` that records each session's calls as rollouts.

    generator: a `ModelGenerate`; its sampling options are the defaults a request may override
    (temperature, top_p, max_tokens, stop; its stop strings and tool-call stops always apply), copied
    once here: each request's settings go to its own generate call and never into the defaults.
    model_name: the `model` clients ask for (others get 404). record_to: a .jsonl file that
    receives every rollout once it is final (`RolloutWriter`). window / max_batch: requests that
    arrive while a batch generates form the next batch; one that finds the gateway idle waits for
    others until none has come for `window` seconds (at most `max_batch` per batch; `gateway.batcher`).
    tool_parsers: how tool calls are read from sampled text (default: Hermes / Qwen `<tool_call>`
    JSON, `tools.parsers.JsonToolCallParser`). max_body_bytes: larger request bodies get 413, refused
    before they are read (`gateway.limits`). session_ttl: seconds a session may stay idle before it is
    finished (its open rollouts written to `record_to`, then forgotten); max_sessions: past this many
    open sessions the least recently used one is finished the same way (None: no limit; see
    `gateway.sessions`). clock: the time source of the TTL (tests pass a fake one).
    """

    def __init__(self, generator, *, model_name: str = "policy", record_to=None, window: float = 0.02,
                 max_batch: int = 64, tool_parsers: Sequence | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, session_ttl: float | None = None,
                 max_sessions: int | None = None, clock=time.monotonic):
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive number of bytes, got {max_body_bytes!r}")
        self.generator, self.model_name = generator, model_name
        # the defaults requests are parsed against: copied once, so a generation in flight with a
        # request's own settings can never leak into the parsing of another request
        self.defaults = dataclasses.replace(generator.config)
        self.vocab_size = len(generator.tokenizer)  # the token ids a request's logit_bias may name
        self.max_body_bytes = max_body_bytes
        self.tool_parsers = tool_parsers
        self.store = SessionStore(ttl=session_ttl, max_sessions=max_sessions, on_finish=self._write, clock=clock)
        self.batcher = Batcher(generator, window, max_batch)
        self._writer = None
        if record_to is not None:
            from SimpleTorchLLMRL.chat.rollout_io import RolloutWriter

            self._writer = RolloutWriter(record_to)
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ the Python API

    def sessions(self) -> list[str]:
        """Names of the sessions that made at least one call."""
        return self.store.names()

    def rollouts(self, session: str) -> list[Rollout]:
        """Every rollout of the session (copies): finished ones, then one per reply of its last call."""
        return self.store.rollouts(session)

    def clear(self, session: str) -> list[Rollout]:
        """Forget the session; returns its rollouts (the ones not yet final are written to `record_to` now)."""
        popped = self.store.pop(session)
        self._locks.pop(session, None)
        self._write([r for s in popped for r in s.open_rollouts()])
        return [r for s in popped for r in s.rollouts()]

    def close(self) -> None:
        """Write the rollouts not yet final of every session to `record_to` and close the file."""
        self._write([r for s in self.store.pop_all() for r in s.open_rollouts()])
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, rollouts: list[Rollout]) -> None:
        if self._writer is not None and rollouts:
            self._writer.write(rollouts)

    @contextlib.contextmanager
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
        """Run the server in a background thread; yields the `.../v1` base URL (port 0: a free port)."""
        _, uvicorn = _fastapi()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="on", http=http_protocol()))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="gateway")
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the gateway did not start on {host}:{port}")
            time.sleep(0.01)
        try:
            yield f"http://{host}:{port}/v1"
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()

    # ------------------------------------------------------------------ the HTTP app

    def app(self):
        """The FastAPI application (serve it with any ASGI server)."""
        fastapi, _ = _fastapi()
        from fastapi.responses import JSONResponse

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.batcher.start()
            sweeper = asyncio.get_running_loop().create_task(self._sweep())  # finishes idle sessions
            yield
            sweeper.cancel()
            await self.batcher.stop()

        app = fastapi.FastAPI(lifespan=lifespan)

        def error(e: RequestError) -> JSONResponse:  # after a 413 the unread body is not drained: close
            return JSONResponse(e.body(), status_code=e.status, headers={"connection": "close"} if e.status == 413 else None)

        @app.exception_handler(Exception)
        async def unexpected(_request, exc: Exception):  # the server keeps serving
            return error(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

        install_routes(self, app, error)  # /v1/models/{id}, /v1/completions, 404 / 405 / 400 in OpenAI's shape

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "SimpleTorchLLMRL"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: fastapi.Request):
            try:
                body = parse_json(await read_body(request, self.max_body_bytes))
                req = parse_request(body, self.model_name, self.defaults, self.vocab_size, self.tool_parsers)
                check_prompt_size(req, self.generator.max_context)
                if req.stream:  # headers as soon as the call is queued; chunks as the rows sample
                    return await self._stream(self.reply_events(session_name(request.headers), req, request), req,
                                              lambda e: _as_request_error(e).body())
                payload = await until_disconnect(request, self._complete(session_name(request.headers), req, request))
            except RequestError as e:
                return error(e)
            if payload is None:  # the client left before its answer was ready: its rows stopped, nothing recorded
                return JSONResponse({}, status_code=499)
            return JSONResponse(payload)

        return app

    # ------------------------------------------------------------------ one call

    @staticmethod
    def session_of(headers) -> tuple[str, bool]:
        """(the session a request names, whether an X-Session-Id names it): `session_name` and its kind."""
        return session_name(headers), bool(headers.get("x-session-id"))

    async def reply_events(self, name: str, req: ChatRequest, request=None, *, explicit: bool | None = None,
                           on_record=None) -> AsyncIterator[Started | TextDelta | Finished]:
        """One chat call of session `name` as it happens: `Started` (queued), `TextDelta`s (with `req.stream`,
        as the rows sample; else the whole content at the end), then `Finished` once it is recorded.

        The delta source of the chat route's stream (and of any other route that streams a reply). Closing
        the iterator before `Finished` (the client left) cancels the call: its rows stop within a few decode
        steps and nothing is recorded. Raises `RequestError` for a request that cannot be generated.
        explicit: the session is named by X-Session-Id (default: read from `request`'s headers).
        on_record(session): called once the call is recorded in it (POST /v1/responses links its response
        id to it)."""
        # an X-Session-Id session's calls run in order (each merges onto the previous, or forks);
        # calls named by an API key only are matched to that key's open sessions by prefix, in parallel
        if explicit is None:
            explicit = request is not None and bool(request.headers.get("x-session-id"))
        lock = self._locks.setdefault(name, asyncio.Lock()) if explicit else contextlib.nullcontext()
        async with lock:
            self.store.expire()
            session, plan = self.store.open(name, req, explicit=explicit)
            listener, future = Listener(asyncio.get_running_loop(), stream=req.stream), None
            try:
                with self.batcher.expect():  # a batch being formed waits for this call
                    prompt_ids, sampling = await asyncio.to_thread(self._prompt_ids, plan.prompt, req)
                    future = self.batcher.enqueue(Job(plan.prompt, sampling, req.n, req.seed, prompt_ids, listener))
                future.add_done_callback(lambda _: listener.queue.put_nowait(DONE))
                yield Started(prompt_ids)
                rows = [self._row_text(req) for _ in range(req.n)]
                while True:
                    new, mark = await next_ids(listener.queue)
                    for j, ids in sorted(new.items()):
                        text = rows[j].feed(ids)
                        if text:
                            yield TextDelta(j, text)
                    if mark is DONE:
                        break
                    if mark is RESET:  # a retry: the rows start over (what was shown stays shown)
                        rows = [dataclasses.replace(self._row_text(req), sent=r.sent) for r in rows]
                try:
                    replies = future.result()
                except ValueError as e:
                    raise bad(str(e)) from e
                choices, shown = [], []
                for i, msg in enumerate(replies):
                    content, calls = reply_view(shown_text(msg, req.stop), req.tools, self.tool_parsers)
                    shown.append(shown_view(content, calls))
                    choices.append(await self._choice(i, msg, content, calls, prompt_ids, req))
                for i, row in enumerate(rows):
                    rest = row.rest(choices[i]["message"]["content"])
                    if rest:
                        yield TextDelta(i, rest)
                self.store.record(session, plan, replies, shown)
                if on_record is not None:
                    on_record(session)
            except BaseException:  # the client left (cancelled, closed) or the call failed: stop its rows
                listener.cancel()
                if future is not None:
                    future.cancel()
                raise
            finally:
                self.store.release(session)
        self._write(plan.closed)
        yield Finished(choices, replies, prompt_ids)

    def _row_text(self, req: ChatRequest) -> RowText:
        openings = tool_openings(self.tool_parsers) if req.tools else ()
        return RowText(self.generator.tokenizer, req.sampling, openings, hide=req.stop)

    async def _complete(self, name: str, req: ChatRequest, request, explicit: bool | None = None,
                        on_record=None) -> dict:
        """The `chat.completion` object of one call (`reply_events` run to its end)."""
        events = self.reply_events(name, req, request, explicit=explicit, on_record=on_record)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Finished):
                    return completion_payload(new_id(), self.model_name, event.choices, event.prompt_ids,
                                              req.return_token_ids)
        raise RuntimeError("the call ended without a result")

    async def _stream(self, events: AsyncIterator, req: ChatRequest, error_body):
        """The call's `chat.completion.chunk` stream: a 4xx before anything was sent when the call cannot be
        queued; then a role chunk per choice at once, content chunks as the rows sample, at the end each
        choice's tool calls and finish_reason (and usage when asked). A client that hangs up cancels the call."""
        try:
            started = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        base = {"id": new_id(), "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        async def chunks():
            async with contextlib.aclosing(events):
                for c in head_chunks(base, req.n, started.prompt_ids if req.return_token_ids else None):
                    yield c
                async for event in events:
                    if isinstance(event, TextDelta):
                        yield chunk(base, event.index, {"content": event.text})
                    elif isinstance(event, Finished):
                        for choice in event.choices:
                            for c in tail_chunks(base, choice, ""):
                                yield c
                        if req.include_usage:
                            done = completion_payload(base["id"], self.model_name, event.choices, event.prompt_ids,
                                                      False)
                            yield {**base, "choices": [], "usage": done["usage"]}

        return sse_stream(chunks(), error_body)

    async def _sweep(self) -> None:
        """Finish the sessions idle past the TTL while no calls come (calls also expire them)."""
        if self.store.ttl is None:
            return
        while True:
            await asyncio.sleep(min(max(self.store.ttl / 4, 0.01), 5.0))
            self.store.expire()

    def _prompt_ids(self, prompt: Rollout, req: ChatRequest) -> tuple[list[int], SamplingConfig]:
        """The ids the model will be conditioned on (as-sampled encoder) and the call's sampling settings; 400
        when they do not fit. A request that left max_tokens out gets the default cut to the context that the
        prompt leaves (as OpenAI and vLLM do); one that set it gets a 400 when prompt + max_tokens do not fit."""
        try:
            ids = encode_prompt(prompt, self.generator.tokenizer)
        except ValueError as e:
            raise bad(f"the messages cannot be encoded for this model: {e}", "messages") from e
        sampling, ctx = req.sampling, self.generator.max_context
        if ctx is not None and len(ids) + sampling.max_new_tokens > ctx:
            if not req.max_tokens_given and len(ids) < ctx:
                sampling = dataclasses.replace(sampling, max_new_tokens=ctx - len(ids))
            else:
                raise bad(f"this model's context is {ctx} tokens; the messages are {len(ids)} tokens and max_tokens is "
                          f"{sampling.max_new_tokens}: shorten the messages or lower max_tokens",
                          "messages", "context_length_exceeded")
        if req.top_logprobs and not self.generator.backend.supports_top_logprobs:
            raise bad("top_logprobs needs the HF backend (this gateway runs vLLM); use logprobs without it",
                      "top_logprobs")
        return ids, sampling

    async def _choice(self, i: int, msg: Message, content, calls, prompt_ids, req: ChatRequest) -> dict:
        finish = finish_reason(msg.finish_reason, calls)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out = {"index": i, "message": message, "finish_reason": finish, "logprobs": None,
               "token_ids": list(msg.token_ids)}
        if req.logprobs:
            top = None
            if req.top_logprobs:
                top = await asyncio.to_thread(top_logprobs, self.generator, prompt_ids, msg, req.top_logprobs)
            out["logprobs"] = logprobs_payload(self.generator.tokenizer, msg.token_ids, msg.logprobs, top)
        return out


def _as_request_error(e: BaseException) -> RequestError:
    if isinstance(e, RequestError):
        return e
    return RequestError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
