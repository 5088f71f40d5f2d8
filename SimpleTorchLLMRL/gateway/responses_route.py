"""POST /v1/responses and GET /v1/responses/{id}: the Responses API at the two ends of the chat pipeline.

`parse` translates a request to a Chat Completions body (`responses.chat_body`) and parses it with
`chat.parse`; `render` turns the chat completion into a Response (`stream`: its events). Sessions, merges,
recording and field checks are the chat path's; its 400s name the Responses fields (`respell`). A stored
response links its session and conversation (`SessionStore.link`), so `previous_response_id` continues them
(docs/gateway.md, "The Responses API").
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import SimpleTorchLLMRL.gateway.chat as chat
from SimpleTorchLLMRL.gateway.request import Finished, GenRequest, RequestError, Result, bad
from SimpleTorchLLMRL.gateway.responses import (
    as_responses_error,
    chat_body,
    new_id,
    reply_message,
    response_object,
    stream_events,
)


@dataclass(frozen=True)
class Link:
    """What a response id names: its conversation (no instructions; its reply last) and the Response."""

    conversation: list[dict]
    response: dict


@dataclass(frozen=True)
class ResponsesOptions:
    body: dict
    history: list[dict]  # the previous response's conversation
    new: list[dict]  # this request's items as chat messages
    chat: chat.ChatOptions
    rid: str
    message_id: str
    created: int


respell = as_responses_error


def previous(store, body) -> tuple:
    """(session, Link) of the request's previous_response_id ((None, None) when it has none); a 400 naming
    it when unknown or finished."""
    rid = body.get("previous_response_id") if isinstance(body, dict) else None
    if rid is None:
        return None, None
    if not isinstance(rid, str):
        raise bad("'previous_response_id' must be a string", "previous_response_id")
    store.expire()
    found = store.linked(rid)
    if found is None:
        raise bad(f"Previous response with id '{rid:.80}' not found: it was never stored here (store: false), or its "
                  "session was finished (session_ttl, max_sessions) or cleared", "previous_response_id",
                  "previous_response_not_found")
    return found


def parse(body, ctx) -> GenRequest:
    """A Responses request as the chat pipeline's `GenRequest`, continuing its previous response's session."""
    session, link = previous(ctx.store, body)
    history = link.conversation if link is not None else []
    body_chat, new = chat_body(body, history)
    req = chat.parse(body_chat, ctx)
    options = ResponsesOptions(body, history, new, req.options, new_id("resp"), new_id("msg"), int(time.time()))
    return dataclasses.replace(req, stream=bool(body.get("stream")), options=options,
                               session=(session.name, session.explicit) if session is not None else None)


def render(result: Result, req: GenRequest, ctx) -> dict:
    """The Response of the finished call, linked to its session when stored."""
    opts: ResponsesOptions = req.options
    payload = chat.render(result, dataclasses.replace(req, options=opts.chat), ctx)
    response = response_object(opts.rid, ctx.model_name, opts.body, payload, opts.message_id,
                               created_at=opts.created)
    if opts.body.get("store") is not False and result.session is not None:
        conversation = [*opts.history, *opts.new, reply_message(payload["choices"][0])]
        ctx.store.link(opts.rid, result.session, Link(conversation, response))
    return response


def stream(started, events, req: GenRequest, ctx):
    """The Response's events: the message's text deltas as the row samples, then the final Response."""
    from SimpleTorchLLMRL.gateway.streaming import TextDelta, sse_stream

    opts: ResponsesOptions = req.options
    start = response_object(opts.rid, ctx.model_name, opts.body, None, opts.message_id, created_at=opts.created)
    finished: list[dict] = []

    async def deltas():
        async for event in events:
            if isinstance(event, TextDelta):
                yield event.text
            elif isinstance(event, Finished):
                finished.append(render(event.result, req, ctx))

    async def finish() -> dict:
        return finished[0]

    async def guarded():
        """The events; a call that fails after the headers went out ends with an `error` event (OpenAI's
        streamed error), not a dropped connection. A client that leaves cancels the call."""
        seq = -1
        try:
            async for e in stream_events(start, opts.message_id, deltas(), finish):
                seq = e["sequence_number"]
                yield e
        except Exception as exc:  # noqa: BLE001  (the status line is sent: the error goes in the stream)
            err = respell(exc if isinstance(exc, RequestError) else RequestError(
                500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
            yield {"type": "error", "sequence_number": seq + 1, "code": err.code, "message": err.message,
                   "param": err.param}
        finally:
            await events.aclose()

    return sse_stream(guarded(), ctx.error_body, named=True, done=False)


def retrieve_route(gateway):
    """GET /v1/responses/{response_id}: a linked response while its session lives, else a 404."""

    async def retrieve(response_id: str):
        gateway.store.expire()
        found = gateway.store.linked(response_id)
        if found is None:
            return gateway.error(RequestError(404, f"No response found with id '{response_id:.80}': responses are "
                                                   "kept while their session lives, and only when stored",
                                              code="response_not_found", param="response_id"))
        return found[1].response

    return retrieve
