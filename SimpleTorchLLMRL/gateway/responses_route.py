"""POST /v1/responses and GET /v1/responses/{id}: the Responses API over the chat path.

A request is translated to the Chat Completions request the chat route takes (`gateway.responses`)
and answered by the same call (`Gateway.reply_events`; a stream's text deltas as the rows sample): the same sessions and merge rule, recording,
batching, limits and field checks. So the OpenAI Agents SDK, whose default model calls this route,
runs with nothing but `base_url` set, and its episodes become rollouts with the exact sampled ids.

`previous_response_id` is a session link: each stored response (`store` left out or true) names its
session and conversation (the conversation without `instructions`, then the reply as the client
was shown it), so a follow-up that sends only its new items continues that conversation, in that
session, and merges into the same rollout. The links live in the `SessionStore`: they go when
their session is finished (TTL, cap, `clear`), and a session keeps its latest `MAX_LINKS`. An
unknown or finished id is a 400 naming `previous_response_id`. `GET /v1/responses/{id}` returns
a linked response while its session lives, else a 404.
"""


import contextlib
import dataclasses
import time
from dataclasses import dataclass

from SimpleTorchLLMRL.gateway.limits import check_prompt_size, parse_json, read_body
from SimpleTorchLLMRL.gateway.openai_format import RequestError, bad, completion_payload, parse_request
from SimpleTorchLLMRL.gateway.responses import (
    as_responses_error,
    chat_body,
    new_id,
    reply_message,
    response_object,
    sse_response,
    stream_events,
)
from SimpleTorchLLMRL.gateway.streaming import Finished, TextDelta, until_disconnect


@dataclass(frozen=True)
class Link:
    """What a response id names: its conversation (no instructions; its reply last) and the Response."""

    conversation: list[dict]
    response: dict


def previous(gateway, body) -> tuple:
    """(session, Link) of the request's previous_response_id ((None, None) when it has none); a 400 naming
    it when unknown or finished."""
    rid = body.get("previous_response_id") if isinstance(body, dict) else None
    if rid is None:
        return None, None
    if not isinstance(rid, str):
        raise bad("'previous_response_id' must be a string", "previous_response_id")
    gateway.store.expire()
    found = gateway.store.linked(rid)
    if found is None:
        raise bad(f"Previous response with id '{rid}' not found: it was never stored here (store: false), or its "
                  "session was finished (session_ttl, max_sessions) or cleared", "previous_response_id",
                  "previous_response_not_found")
    return found


def responses_routes(gateway, error):
    """The FastAPI endpoints (create, retrieve) of the Responses API over `gateway` (a `Gateway`)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def create(request: Request):
        try:
            body = parse_json(await read_body(request, gateway.max_body_bytes))
            session, link = previous(gateway, body)
            history = link.conversation if link is not None else []
            chat, new = chat_body(body, history)
            if session is not None:  # the link names the session: continue it there
                name, explicit = session.name, session.explicit
            else:
                name, explicit = gateway.session_of(request.headers)
            recorded = []
            try:  # the chat path's checks and call; its 400s name the Responses fields
                req = parse_request(chat, gateway.model_name, gateway.defaults, gateway.vocab_size,
                                    gateway.tool_parsers)
                check_prompt_size(req, gateway.generator.max_context)
                if body.get("stream"):
                    req = dataclasses.replace(req, stream=True)  # deltas as the row samples
                    events = gateway.reply_events(name, req, request, explicit=explicit, on_record=recorded.append)
                    try:
                        await anext(events)  # queued: what cannot be generated is a 4xx before any event
                    except BaseException:
                        await events.aclose()
                        raise
                else:
                    payload = await until_disconnect(request, gateway._complete(
                        name, req, request, explicit=explicit, on_record=recorded.append))
            except RequestError as e:
                raise as_responses_error(e) from e
        except RequestError as e:
            return error(e)
        if not body.get("stream") and payload is None:  # the client left: its rows stopped, nothing recorded
            return JSONResponse({}, status_code=499)
        rid, message_id, created = new_id("resp"), new_id("msg"), int(time.time())

        def answer(payload: dict) -> dict:
            """The Response of the finished call, linked to its session when stored."""
            response = response_object(rid, gateway.model_name, body, payload, message_id, created_at=created)
            if body.get("store") is not False and recorded:
                conversation = [*history, *new, reply_message(payload["choices"][0])]
                gateway.store.link(rid, recorded[0], Link(conversation, response))
            return response

        if not body.get("stream"):
            return JSONResponse(answer(payload))
        start = response_object(rid, gateway.model_name, body, None, message_id, created_at=created)
        finished: list[dict] = []

        async def deltas():
            """The reply's shown text as it is sampled (`Gateway.reply_events`), then the call's payload kept."""
            async for event in events:
                if isinstance(event, TextDelta):
                    yield event.text
                elif isinstance(event, Finished):
                    finished.append(completion_payload(new_id("chatcmpl"), gateway.model_name, event.choices,
                                                       event.prompt_ids, req.return_token_ids))

        async def finish() -> dict:
            return answer(finished[0])

        async def guarded():
            """The events; a call that fails after the headers went out ends the stream with an `error` event
            (OpenAI's streamed error), not a dropped connection. A client that leaves cancels the call."""
            seq = -1
            async with contextlib.aclosing(events):
                try:
                    async for e in stream_events(start, message_id, deltas(), finish):
                        seq = e["sequence_number"]
                        yield e
                except Exception as exc:  # noqa: BLE001  (the status line is sent: the error goes in the stream)
                    err = as_responses_error(exc if isinstance(exc, RequestError) else RequestError(
                        500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
                    yield {"type": "error", "sequence_number": seq + 1, "code": err.code, "message": err.message,
                           "param": err.param}

        return sse_response(guarded())

    async def retrieve(response_id: str):
        gateway.store.expire()
        found = gateway.store.linked(response_id)
        if found is None:
            return error(RequestError(404, f"No response found with id '{response_id}': responses are kept while "
                                           "their session lives, and only when stored (store: true)",
                                      code="response_not_found", param="response_id"))
        return found[1].response

    return create, retrieve
