"""Streaming and cancellation: a call's sampled ids as they arrive, shown as text deltas, and the hang-up of its
client passed back to the decode loop.

    listener = Listener(loop, stream=True)          # one per call, handed to the batcher with its Job
    # worker thread (the decode loop, through model.generation.watch.DecodeWatch): listener.push([(j, ids), ...])
    # event loop: `await listener.queue.get()` -> [(j, ids)] ... then DONE once the job's future is set
    listener.cancel()                                # the client left: its rows stop within a few steps

`RowText` turns one row's ids into the text that may be shown so far: it decodes incrementally (never a
partial UTF-8 character), ends the row at an EOS id or a stop string (the text through the stop, as
`sampling.cut_sample` cuts it), and holds back text that may still become a stop string or, with tools
offered, a tool call (from its opening tag; tool calls go out as `tool_calls` deltas at the end).
`stream_chunks` builds the `chat.completion.chunk` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig, text_through_stop

DONE = object()  # put on a listener's queue once its job's future is set
RESET = object()  # put on it when the job is generated again (a retry): its ids start over


class Listener:
    """One call's link to the decode loop: the ids its rows sample (when it streams), and its cancel flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool):
        self.loop, self.stream = loop, stream
        self.queue: asyncio.Queue = asyncio.Queue()  # lists of (sample j, new ids); RESET; DONE
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()

    def push(self, items: list[tuple[int, list[int]]]) -> None:
        """From the generating thread: the new ids of some of this call's samples."""
        if self.stream and not self.cancelled:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, items)

    def reset(self) -> None:
        """From the generating thread: the call is generated again (a retry), its ids start over."""
        if self.stream:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, RESET)


def tool_openings(parsers: Sequence | None) -> tuple[str, ...] | None:
    """The texts a tool call starts with under `parsers` (default: Hermes' `<tool_call>`); None when a parser
    does not say (then a reply with tools offered is shown only once it is complete)."""
    if not parsers:
        return ("<tool_call>",)
    out = []
    for p in parsers:
        if isinstance(getattr(p, "open_tag", None), str):
            out.append(p.open_tag)
        elif hasattr(p, "tags") and type(p).__name__ == "TagToolCallParser":
            out.extend(f"<{t}>" for t in p.tags)
        elif type(p).__name__ == "CodeBlockParser":
            out.append("```")
        else:
            return None
    return tuple(out)


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


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
        safe = self.text
        if self.hide:  # a hidden stop string is whole only where it ended the row
            at = min((i for i in (safe.find(h) for h in self.hide) if i >= 0), default=len(safe))
            safe = safe[:at]
        if self.openings:
            at = min((i for i in (safe.find(o) for o in self.openings) if i >= 0), default=-1)
            if at >= 0:
                safe = safe[:at]
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


# ----------------------------------------------------------------------------- chunks


def chunk(base: dict, index: int, delta: dict, finish=None, logprobs=None, extra: dict | None = None) -> dict:
    return {**base, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
                                 **(extra or {})}]}


def head_chunks(base: dict, n: int, prompt_ids: list[int] | None) -> list[dict]:
    """One role chunk per choice (the first carries `prompt_token_ids` when asked)."""
    out = [chunk(base, i, {"role": "assistant", "content": ""}) for i in range(n)]
    if prompt_ids is not None:
        out[0]["prompt_token_ids"] = list(prompt_ids)
    return out


def tail_chunks(base: dict, choice: dict, rest: str) -> list[dict]:
    """A choice's end: the rest of its content (with its log-probs when asked), its tool calls, its finish."""
    out, i = [], choice["index"]
    if rest or choice.get("logprobs") is not None:
        out.append(chunk(base, i, {"content": rest}, logprobs=choice.get("logprobs")))
    for j, call in enumerate(choice["message"].get("tool_calls") or []):
        out.append(chunk(base, i, {"tool_calls": [{"index": j, **call}]}))
    extra = {"token_ids": choice["token_ids"]} if "token_ids" in choice else None
    out.append(chunk(base, i, {}, finish=choice["finish_reason"], extra=extra))
    return out


# ----------------------------------------------------------------------------- what a call yields


@dataclass
class Started:
    """The call is queued for generation: the ids its prompt was encoded to."""

    prompt_ids: list[int]


@dataclass
class TextDelta:
    """More content of choice `index` (text deltas of a choice, concatenated, are its final content)."""

    index: int
    text: str


@dataclass
class Finished:
    """The call is done and recorded: OpenAI choice dicts (index, message, finish_reason, logprobs, token_ids),
    the sampled MODEL messages, the prompt ids."""

    choices: list[dict]
    replies: list
    prompt_ids: list[int]


async def next_ids(queue: asyncio.Queue) -> tuple[dict[int, list[int]], object | None]:
    """Everything queued now (waiting for one item at least): the new ids per sample, and DONE / RESET when
    one came (what came after it stays queued)."""
    items, mark = [await queue.get()], None
    while items[-1] is not DONE and items[-1] is not RESET and not queue.empty():
        items.append(queue.get_nowait())
    if items[-1] is DONE or items[-1] is RESET:
        mark = items.pop()
    merged: dict[int, list[int]] = {}
    for item in items:
        for j, ids in item:
            merged.setdefault(j, []).extend(ids)
    return merged, mark


def sse_stream(chunks, error_body):
    """Server-sent events of the async iterator `chunks` (JSON payloads), then `[DONE]`; an exception after
    the headers went out becomes an `{"error": ...}` event (`error_body(exc)`), as OpenAI streams errors."""
    import json

    from fastapi.responses import StreamingResponse

    async def events():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except Exception as e:  # noqa: BLE001  (the status line is sent: the error goes in the stream)
            yield f"data: {json.dumps(error_body(e))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


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
