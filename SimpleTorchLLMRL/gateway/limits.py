"""What the gateway refuses before it spends memory or time on a request.

    raw = await read_body(request, max_body_bytes)   # 413 past the limit, checked while reading
    body = parse_json(raw)                            # 400: not JSON, or nested deeper than MAX_JSON_DEPTH
    check_prompt_size(req, max_context)               # 400 before any tokenization when far too long

A body larger than the limit is refused from its Content-Length header before a byte of it
is read, and a chunked one as soon as the bytes read pass the limit: nothing past the limit
is ever held in memory.
"""

from __future__ import annotations

import json
from typing import Any

from SimpleTorchLLMRL.gateway.openai_format import ChatRequest, RequestError, bad

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 100
# No real tokenizer averages more characters per token than this over a whole prompt, so a prompt
# longer than max_context * CHARS_PER_TOKEN characters cannot fit, and is refused without tokenizing.
CHARS_PER_TOKEN = 32


def too_large(size: int | None, limit: int) -> RequestError:
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return RequestError(413, f"the request body is {what}; this gateway accepts at most {limit} bytes "
                             "(Gateway(max_body_bytes=...), --max-body-bytes)", code="request_too_large")


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 once it is known to pass `limit` bytes: from Content-Length
    before reading, else (a chunked body) as soon as the bytes read pass it."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise bad(f"the Content-Length header is not a byte count: {length!r}")
        if int(length) > limit:
            raise too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` nests lists / objects more than `limit` levels deep (iterative: no recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        items = node.values() if isinstance(node, dict) else node
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return False


def parse_json(raw: bytes) -> Any:
    """The body as JSON; 400 when it is not JSON or nests deeper than MAX_JSON_DEPTH levels."""
    try:
        body = json.loads(raw)
    except RecursionError as e:
        raise bad(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from e
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise bad(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    return body


def prompt_chars(req: ChatRequest) -> int:
    """Characters the prompt is rendered from: message contents, their tool calls, the tools."""
    n = 0
    for turn in req.chat:
        n += len(turn.get("content") or "")
        if turn.get("tool_calls"):
            n += len(json.dumps(turn["tool_calls"]))
    return n + (len(json.dumps(req.tools)) if req.tools else 0)


def check_prompt_size(req: ChatRequest, max_context: int | None) -> None:
    """400 (context_length_exceeded) when the messages are too long to fit even at CHARS_PER_TOKEN
    characters a token: a bound that costs no tokenization."""
    if max_context is None:
        return
    chars, limit = prompt_chars(req), max_context * CHARS_PER_TOKEN
    if chars > limit:
        raise bad(f"this model's context is {max_context} tokens; the messages are {chars} characters, more than "
                  f"{CHARS_PER_TOKEN} characters a token could fit ({limit}): shorten the messages",
                  "messages", "context_length_exceeded")
