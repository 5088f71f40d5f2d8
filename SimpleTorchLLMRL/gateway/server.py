"""`Gateway`: an OpenAI-compatible server over a `ModelGenerate` that records what it sampled.

    gw = Gateway(generator)                                  # HF or vLLM backend
    with gw.serve(host="127.0.0.1", port=0) as url:          # url: "http://127.0.0.1:PORT/v1"
        client = OpenAI(base_url=url, api_key="episode-17")   # the API key names the session
        ...                                                  # any agent written against the OpenAI API
    rollouts = gw.rollouts("episode-17")                     # list[Rollout], ready for GRPO

One pipeline serves every route; a route only supplies the two ends (`routes.Route`):

    parse (wire -> GenRequest) -> grammar (built and compiled off the event loop, within a budget)
      -> session plan (merge / fork: `gateway.sessions`) -> encode (off the event loop)
      -> run (`gateway.batcher`; a stream's `streaming.Listener`) -> record -> render (Result -> wire)

The routes, and how a session is named: docs/gateway.md, "The API" and "Sessions".
"""


import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.gateway.batcher import Batcher, Job, NamedLocks
from SimpleTorchLLMRL.gateway.chat import reply_choice
from SimpleTorchLLMRL.gateway.request import (
    DEFAULT_MAX_BODY_BYTES,
    Finished,
    GenRequest,
    RequestError,
    Result,
    Started,
    bad,
    check_prompt_size,
    parse_json,
    read_body,
)
from SimpleTorchLLMRL.gateway.sessions import Plan, SessionStore, shown_view
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

ANONYMOUS = "default"
INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop, larger ones on a thread


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

    generator: a `ModelGenerate`; its sampling options, copied once, are the defaults a request may override
    (its stop strings and tool-call stops always apply). model_name: the `model` clients ask for (others get
    404). record_to: a .jsonl file that receives every rollout once it is final (`RolloutWriter`). window /
    max_batch: how requests form batches (`gateway.batcher`). tool_parsers: how tool calls are read from
    sampled text (default: `<tool_call>` JSON, `JsonToolCallParser`). max_body_bytes: larger bodies get 413,
    before they are read. session_ttl / max_sessions: the idle seconds, and the open sessions, past which a
    session is finished: its open rollouts written to `record_to`, then forgotten (None: no limit).
    compile_budget: seconds a request's grammar may take to build and compile (past it, a 400 naming the
    field). admin_key: serves the session routes (GET /v1/sessions, POST /v1/sessions/{id}/finish) to
    `Authorization: Bearer <admin_key>` only (None: not served). clock: the time source of the TTL.
    """

    def __init__(self, generator, *, model_name: str = "policy", record_to=None, window: float = 0.02,
                 max_batch: int = 64, tool_parsers: Sequence | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, session_ttl: float | None = None,
                 max_sessions: int | None = None, compile_budget: float = 10.0, admin_key: str | None = None,
                 clock=time.monotonic):
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive number of bytes, got {max_body_bytes!r}")
        if admin_key is not None and (not isinstance(admin_key, str) or not admin_key.strip()):
            raise ValueError("admin_key must be a non-empty string or None")
        if not compile_budget > 0:
            raise ValueError(f"compile_budget must be a positive number of seconds, got {compile_budget!r}")
        self.generator, self.model_name, self.tool_parsers = generator, model_name, tool_parsers
        self.tokenizer = generator.tokenizer
        # the defaults requests are parsed against: copied once, so a generation in flight with a
        # request's own settings can never leak into the parsing of another request
        self.defaults = dataclasses.replace(generator.config)
        self.vocab_size = len(generator.tokenizer)  # the token ids a request's logit_bias may name
        self.supports_top_logprobs = generator.backend.supports_top_logprobs
        self.max_body_bytes, self.compile_budget, self.admin_key = max_body_bytes, compile_budget, admin_key
        self.store = SessionStore(ttl=session_ttl, max_sessions=max_sessions, on_finish=self._write, clock=clock)
        self.locks = NamedLocks()  # X-Session-Id -> its calls' lock, while one is in flight
        self.batcher = Batcher(generator, window, max_batch)
        self._grammars = None  # structured.GrammarCompiler, made for the first request with a grammar
        self._writer = None
        if record_to is not None:
            from SimpleTorchLLMRL.chat.rollout_io import RolloutWriter

            self._writer = RolloutWriter(record_to)

    @property
    def max_context(self) -> int | None:
        return self.generator.max_context

    # ------------------------------------------------------------------ the Python API

    def sessions(self) -> list[str]:
        """Names of the sessions that made at least one call."""
        return self.store.names()

    def rollouts(self, session: str) -> list[Rollout]:
        """Every rollout of the session (copies): finished ones, then one per reply of its last call."""
        return self.store.rollouts(session)

    def take(self, session_ids) -> dict[str, list[Rollout]]:
        """Finish those sessions (names; a str is one): {id: its rollouts} (finished ones, then one per reply of its
        last call; [] for an id without a session), removed from the gateway; the ones not yet final are written
        to `record_to` now. A session with a call in flight is a ValueError, and nothing is taken."""
        ids = [session_ids] if isinstance(session_ids, str) else list(session_ids)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError(f"session_ids must be session names (str), got {ids!r:.200}")
        taken = self.store.take(ids)
        self._write([r for sessions in taken.values() for s in sessions for r in s.open_rollouts()])
        return {name: [r for s in sessions for r in s.rollouts()] for name, sessions in taken.items()}

    def clear(self, session: str) -> list[Rollout]:
        """Forget one session; returns its rollouts (`take` of one: a ValueError while it has a call in flight)."""
        return self.take([session])[session]

    def close(self) -> None:
        """Write the rollouts not yet final of every session to `record_to` and close the file."""
        self._write([r for s in self.store.pop_all() for r in s.open_rollouts()])
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._grammars is not None:
            self._grammars.close()

    def _write(self, rollouts: list[Rollout]) -> None:
        if self._writer is not None and rollouts:
            self._writer.write(rollouts)

    @contextlib.contextmanager
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
        """Run the server in a background thread; yields the `.../v1` base URL (port 0: a free port)."""
        from SimpleTorchLLMRL.gateway.routes import http_protocol

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
        """The FastAPI application (serve it with any ASGI server): only the documented routes answer."""
        fastapi, _ = _fastapi()
        from SimpleTorchLLMRL.gateway.responses_route import retrieve_route
        from SimpleTorchLLMRL.gateway.routes import install, install_admin, routes

        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.batcher.start()
            sweeper = asyncio.get_running_loop().create_task(self._sweep())  # finishes idle sessions
            yield
            sweeper.cancel()
            await self.batcher.stop()

        app = fastapi.FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        install(self, app)  # /health, /v1/models, /v1/models/{id}; 404 / 405 / 400 / 500 in OpenAI's shape
        if self.admin_key is not None:
            install_admin(self, app)  # /v1/sessions, /v1/sessions/{id}/finish
        for route in routes():
            app.post(route.path)(self._handler(route))
        app.get("/v1/responses/{response_id}")(retrieve_route(self))
        return app

    def error(self, e: RequestError):
        """The response of a refused request (after a 413 the unread body is not drained: close)."""
        from fastapi.responses import JSONResponse

        return JSONResponse(e.body(), status_code=e.status, headers={"connection": "close"} if e.status == 413 else None)

    @staticmethod
    def error_body(e: BaseException) -> dict:
        """An exception as the error payload a stream ends with."""
        if not isinstance(e, RequestError):
            e = RequestError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
        return e.body()

    @staticmethod
    def session_of(headers) -> tuple[str, bool]:
        """(the session a request names, whether an X-Session-Id names it): `session_name` and its kind."""
        return session_name(headers), bool(headers.get("x-session-id"))

    def _handler(self, route):
        """The endpoint of a generation route: read, parse, run the pipeline, render (or stream)."""
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def handle(request: Request):
            try:
                raw = await read_body(request, self.max_body_bytes)
                if len(raw) > INLINE_BYTES:  # a large body is parsed on a worker thread, not the event loop
                    req = await asyncio.to_thread(lambda: route.parse(parse_json(raw, True, route.longest), self))
                else:
                    req = route.parse(parse_json(raw), self)
                check_prompt_size(req, self.max_context)
                where = req.session or self.session_of(request.headers)
                if req.stream and route.stream is not None:
                    return await self._stream(route, req, where)
                result = await until_disconnect(request, self.complete(req, where))
                if result is None:  # the client left before its answer was ready: rows stopped, nothing recorded
                    return JSONResponse({}, status_code=499)
                out = route.render(result, req, self)
            except RequestError as e:
                return self.error(route.respell(e) if route.respell is not None else e)
            return JSONResponse(out) if isinstance(out, dict) else out

        return handle

    async def _stream(self, route, req: GenRequest, where: tuple[str, bool]):
        """A live stream: what cannot be generated is a 4xx before the headers; then the route's events."""
        from SimpleTorchLLMRL.gateway.streaming import Listener

        events = self.events(req, where, Listener.of(req, self.tokenizer, self.tool_parsers))
        try:
            started = await anext(events)
        except BaseException:
            await events.aclose()
            raise
        return route.stream(started, events, req, self)

    # ------------------------------------------------------------------ the pipeline

    async def complete(self, req: GenRequest, where: tuple[str, bool]) -> Result:
        """One request through the pipeline to its result (`events` run to `Finished`)."""
        events = self.events(req, where)
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Finished):
                    return event.result
        raise RuntimeError("the call ended without a result")

    async def events(self, req: GenRequest, where: tuple[str, bool], listener=None) -> AsyncIterator:
        """The pipeline of one request: `Started` once queued, a stream's `TextDelta`s (with a `listener`), then
        `Finished` once recorded. Closing it before `Finished` (the client left) cancels the call: its rows stop
        within a few decode steps and nothing is recorded. `where`: (session name, named by X-Session-Id)."""
        sampling = req.sampling if req.grammar is None else await self.grammars().sampling(req.grammar, req.sampling)
        recorded = req.recorded
        # an X-Session-Id session's calls run in order (each merges onto the previous, or forks);
        # calls named by an API key only are matched to that key's open sessions by prefix, in parallel
        async with self.locks.hold(where[0]) if recorded and where[1] else contextlib.nullcontext():
            if recorded:
                self.store.expire()
            session, plan = self.store.open(where[0], req, explicit=where[1]) if recorded else (None, None)
            jobs: list[Job] = []
            try:
                with self.batcher.expect():  # a batch being formed waits for this call
                    prompts, sampling = await asyncio.to_thread(self._encode, req, plan, sampling)
                    if listener is not None:
                        listener.use(sampling)
                    jobs = [self.batcher.enqueue(Job(ids, sampling, req.n, req.seed, listener, k * req.n))
                            for k, ids in enumerate(prompts)]
                yield Started(prompts)
                if listener is not None:
                    async for delta in listener.deltas(jobs):
                        yield delta
                result = await self._result(req, prompts, jobs, session)
                if listener is not None:
                    for delta in listener.rest(result):
                        yield delta
                if session is not None:
                    self.store.record(session, plan, [c.message for c in result.choices],
                                      [tuple(c.message.token_ids) if req.tokens is not None
                                       else shown_view(c.content, c.tool_calls) for c in result.choices])
            except BaseException:  # the client left (cancelled, closed) or the call failed: stop its rows
                for job in jobs:
                    job.cancel()
                raise
            finally:
                if session is not None:
                    self.store.release(session)
        self._write(plan.closed if plan is not None else [])
        yield Finished(result)

    def grammars(self):
        if self._grammars is None:
            from SimpleTorchLLMRL.gateway.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.generator.backend.prepare_grammar, self.compile_budget)
        return self._grammars

    def _encode(self, req: GenRequest, plan: Plan | None, sampling: SamplingConfig):
        """The prompts' ids (a conversation by its template, as sampled; token ids and raw text as they are) and
        the call's settings; 400 when they do not fit. A request that left max_tokens out gets the default cut
        to the context that the prompt leaves (as OpenAI and vLLM do); one that set it gets a 400. The context
        message of a token call's new ids gets their text here, off the event loop."""
        param = "messages" if req.messages is not None else "token_ids" if req.tokens is not None else "prompt"
        try:
            if req.messages is not None:
                prompts = [encode_prompt(plan.prompt, self.tokenizer)]
            elif req.tokens is not None:
                prompts, tail = [list(req.tokens)], plan.prompt[-1] if plan is not None and len(plan.prompt) else None
                if tail is not None and tail.type is not MessageType.MODEL and not tail.content:
                    tail.content = self.tokenizer.decode(tail.token_ids)
            else:
                prompts = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in req.prompts]
        except ValueError as e:
            raise bad(f"the {param} cannot be encoded for this model: {e}", param) from e
        if not all(prompts):
            raise bad(f"a {param} encodes to no tokens", param)
        longest, ctx = max(len(p) for p in prompts), self.max_context
        if ctx is not None and longest + sampling.max_new_tokens > ctx:
            if not req.max_tokens_given and longest < ctx:
                sampling = dataclasses.replace(sampling, max_new_tokens=ctx - longest)
            else:
                raise bad(f"this model's context is {ctx} tokens; the {param} is {longest} tokens and max_tokens is "
                          f"{sampling.max_new_tokens}: shorten it or lower max_tokens", param, "context_length_exceeded")
        return prompts, sampling

    async def _result(self, req: GenRequest, prompts: list[list[int]], jobs: list[Job], session) -> Result:
        """The call's choices as shown (`chat.reply_choice`), with their top log-probs when asked."""
        try:
            replies = [await job.future for job in jobs]
        except ValueError as e:
            raise bad(str(e)) from e
        choices = [reply_choice(k * req.n + j, msg, req, self.tool_parsers, prompt=k)
                   for k, msgs in enumerate(replies) for j, msg in enumerate(msgs)]
        for c in choices if req.top_logprobs else ():
            c.top = await asyncio.to_thread(self.generator.backend.top_logprobs, prompts[c.prompt],
                                            list(c.message.token_ids), c.message.temperature or 1.0, req.top_logprobs)
        return Result(prompts, choices, session)

    async def _sweep(self) -> None:
        """Finish the sessions idle past the TTL while no calls come (calls also expire them)."""
        if self.store.ttl is None:
            return
        while True:
            await asyncio.sleep(min(max(self.store.ttl / 4, 0.01), 5.0))
            self.store.expire()


async def until_disconnect(request, work):
    """`await work`, unless the client hangs up first: then `work` is cancelled (a call's rows stop) and the
    result is None. The disconnect is ASGI's `http.disconnect`, which uvicorn sends once the connection drops."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()
