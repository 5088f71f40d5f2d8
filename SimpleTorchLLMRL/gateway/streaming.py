"""Streaming: a call's sampled ids as they arrive, shown as text deltas; the chat route's chunk stream.

Only a request that streams runs this code: the pipeline (`server.Gateway.events`) takes a `Listener` for it
(fed from the decode loop's thread) and yields its deltas. `RowText` decodes one row incrementally and holds
back text that may still become a stop string or a tool call (docs/gateway.md, "Streaming and hang-ups").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from SimpleTorchLLMRL.gateway.chat import choice_object, held_suffix, tool_openings
from SimpleTorchLLMRL.gateway.request import Finished, GenRequest, Result, new_id, without_stop
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig, text_through_stop

RESET = object()  # put on a listener's queue when its jobs are generated again (a retry): their ids start over


@dataclass
class TextDelta:
    """More content of choice `index` (a choice's text deltas, concatenated, are its final content)."""

    index: int
    text: str


@dataclass
class RowText:
    """The text of one sampled row as its ids arrive, and how much of it may be shown now.

    openings: tool-call openings to hold back from (None: hold everything until the end; empty: no tools)."""

    tokenizer: object
    sampling: SamplingConfig
    openings: tuple[str, ...] | None = ()
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (complete characters only)
    done: bool = False  # ended: EOS id, stop string or max tokens
    sent: str = ""  # what was shown
    _prefix: int = 0  # incremental decoding: ids[_prefix:_read] decode to the text's last piece
    _read: int = 0
    hide: tuple[str, ...] = ()  # stop strings never shown (the request's own: OpenAI leaves them out)

    def feed(self, ids: Sequence[int]) -> str:
        """Take the row's next ids; returns the text that may be shown now and was not yet."""
        if self.done:
            return ""
        eos, limit = set(self.sampling.eos_token_ids), self.sampling.max_new_tokens
        for t in ids:
            self.ids.append(int(t))
            if int(t) in eos or len(self.ids) >= limit:
                self.done = True
                break
        self._decode()
        stops = self.sampling.all_stops
        if stops:
            cut = text_through_stop(self.text, stops)
            if len(cut) < len(self.text) or any(s in cut for s in stops):
                self.text, self.done = cut, True
        return self._show(stops)

    def _decode(self) -> None:
        """The text of the new ids, decoded with the ids before them as context (as text-generation servers
        do); held while it ends in a partial UTF-8 character."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def _show(self, stops: Sequence[str]) -> str:
        if self.openings is None:
            return ""
        # up to a hidden stop string (whole only where it ended the row), then up to a tool call's opening
        safe = without_stop(without_stop(self.text, self.hide), self.openings)
        if not self.done or self.openings:
            safe = safe[: len(safe) - held_suffix(safe, (*stops, *self.openings))]
        if self.openings:
            safe = safe.rstrip()  # whitespace before a tool call is not content
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        new, self.sent = safe[len(self.sent):], safe
        return new

    def rest(self, content: str | None) -> str:
        """What is left to show of the reply's final `content` (nothing when it does not extend what was shown:
        with tools offered and a call parsed, whitespace the reply began with is not content)."""
        content = content or ""
        for shown in (self.sent, self.sent.lstrip()):
            if content.startswith(shown):
                return content[len(shown):]
        return ""


class Listener:
    """One streamed call's link to the decode loop: the ids its rows sample, shown as text deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rows: list[RowText]):
        self.loop, self.rows = loop, rows
        self.queue: asyncio.Queue = asyncio.Queue()  # lists of (choice, new ids); RESET; a finished job

    @classmethod
    def of(cls, req: GenRequest, tokenizer, parsers) -> Listener:
        """A listener for `req`'s choices (n per prompt)."""
        openings = tool_openings(parsers) if req.tools else ()
        count = req.n * (len(req.prompts) if req.prompts is not None else 1)
        rows = [RowText(tokenizer, req.sampling, openings, hide=req.stop) for _ in range(count)]
        return cls(asyncio.get_running_loop(), rows)

    def use(self, sampling: SamplingConfig) -> None:
        """The call's settings as it runs them (its grammar, its max_new_tokens cut to the context)."""
        for row in self.rows:
            row.sampling = sampling

    def push(self, items: list[tuple[int, list[int]]]) -> None:
        """From the generating thread: the new ids of some of this call's choices."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, items)

    def reset(self) -> None:
        """From the generating thread: a job is generated again (a retry), its ids start over."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, RESET)

    async def deltas(self, jobs: list) -> AsyncIterator[TextDelta]:
        """The text the rows may show, as their ids arrive, until every job's future is set."""
        for job in jobs:
            job.future.add_done_callback(lambda f: self.queue.put_nowait(f))
        left = len(jobs)
        while left:
            item = await self.queue.get()
            if isinstance(item, asyncio.Future):
                left -= 1
            elif item is RESET:  # what was shown stays shown; the rows decode again from the start
                self.rows = [RowText(r.tokenizer, r.sampling, r.openings, hide=r.hide, sent=r.sent) for r in self.rows]
            else:
                for j, ids in item:
                    text = self.rows[j].feed(ids)
                    if text:
                        yield TextDelta(j, text)

    def rest(self, result: Result) -> list[TextDelta]:
        """Each choice's final content past what was shown."""
        out = [TextDelta(c.index, self.rows[c.index].rest(c.content)) for c in result.choices]
        return [d for d in out if d.text]


# ----------------------------------------------------------------------------- the chat stream


def chunk(base: dict, index: int, delta: dict, finish=None, logprobs=None, extra: dict | None = None) -> dict:
    return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
                                 **(extra or {})}]}


def head_chunks(base: dict, n: int, prompt_ids: list[int] | None) -> list[dict]:
    """One role chunk per choice (the first carries `prompt_token_ids` when asked)."""
    out = [chunk(base, i, {"role": "assistant", "content": ""}) for i in range(n)]
    if prompt_ids is not None:
        out[0]["prompt_token_ids"] = list(prompt_ids)
    return out


def tail_chunks(base: dict, choice: dict) -> list[dict]:
    """A choice's end: its log-probs when asked, its tool calls, its finish (and token ids when asked)."""
    out, i = [], choice["index"]
    if choice.get("logprobs") is not None:
        out.append(chunk(base, i, {"content": ""}, logprobs=choice["logprobs"]))
    for j, call in enumerate(choice["message"].get("tool_calls") or []):
        out.append(chunk(base, i, {"tool_calls": [{"index": j, **call}]}))
    extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else None
    out.append(chunk(base, i, {}, finish=choice["finish_reason"], extra=extra))
    return out


def chat_stream(started, events: AsyncIterator, req: GenRequest, ctx):
    """The call's `chat.completion.chunk` stream: a role chunk per choice at once, content chunks as the rows
    sample, at the end each choice's tool calls and finish_reason (and usage when asked)."""
    opts = req.options
    base = {"id": new_id(), "object": "chat.completion.chunk", "created": int(time.time()), "model": ctx.model_name}

    async def chunks():
        async with contextlib.aclosing(events):
            for c in head_chunks(base, req.n, started.prompt_ids[0] if opts.return_token_ids else None):
                yield c
            async for event in events:
                if isinstance(event, TextDelta):
                    yield chunk(base, event.index, {"content": event.text})
                elif isinstance(event, Finished):
                    for c in event.result.choices:
                        for part in tail_chunks(base, choice_object(c, opts, ctx.tokenizer)):
                            yield part
                    if opts.include_usage:
                        yield {**base, "choices": [], "usage": event.result.usage()}

    return sse_stream(chunks(), ctx.error_body)


def sse_stream(chunks, error_body, named: bool = False, done: bool = True):
    """Server-sent events of the async iterator `chunks` (JSON payloads; `named`: each as an event of its
    `type`), then `[DONE]`; an exception after the headers went out becomes an error event (`error_body(exc)`),
    as OpenAI streams errors."""
    from fastapi.responses import StreamingResponse

    def line(c: dict) -> str:
        return (f"event: {c['type']}\n" if named else "") + f"data: {json.dumps(c)}\n\n"

    async def events():
        try:
            async for c in chunks:
                yield line(c)
        except Exception as e:  # noqa: BLE001  (the status line is sent: the error goes in the stream)
            yield line(error_body(e))
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
