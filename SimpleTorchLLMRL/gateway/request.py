"""What every route shares at the two ends of the pipeline: the one request type and the reply it shows.

    raw = await read_body(request, max_body_bytes)   # 413 past the limit, checked while reading
    body = parse_json(raw)                            # 400: not JSON, nested too deep, not valid Unicode
    req = <route>.parse(body, ctx) -> GenRequest      # each route's parse, built from the field checks here
    ... the pipeline (`server.Gateway.events`) ...
    Result(prompt_ids, choices, session)              # each route's render reads it

Every field is checked for its JSON type and range before anything is spent on the request
(docs/gateway.md, "Every request field").
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.chat.message import Message
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 100
MAX_N = 64
MAX_SEED = 2**63 - 1  # a signed 64-bit integer, what the backends' generators take
# No real tokenizer averages more characters per token than this over a whole prompt, so a prompt
# longer than max_context * CHARS_PER_TOKEN characters cannot fit, and is refused without tokenizing.
CHARS_PER_TOKEN = 32
# a generator finish_reason as OpenAI's; a turn that stopped at a tool-call stop string is "tool_calls"
# only when calls were parsed from it (`finish_reason`), else it is a plain "stop"
FINISH = {"stop": "stop", "length": "length", "tool_call": "stop"}


class RequestError(Exception):
    """A request the gateway refuses: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, code=code, param=param)


# ----------------------------------------------------------------------------- the body


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


# a UTF-16 surrogate written as a JSON escape: the only way a JSON text can hold one (raw UTF-8 cannot)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")  # what a str holds that UTF-8 cannot encode
YIELD_EVERY = 2000  # nodes a walk checks between two releases of the GIL (a large body, off the event loop)


def parse_json(raw: bytes, piecewise: bool = False, longest: dict[str, int] | None = None) -> Any:
    """The body as JSON; 400 when it is not JSON, nests deeper than MAX_JSON_DEPTH levels, or holds a string
    that is not valid Unicode (named by its top-level field). Strings are walked only when the raw text holds
    a surrogate escape; the walk lets other threads run every YIELD_EVERY nodes. piecewise (a large body, on
    a worker thread): decoded one top-level member, and one element of a top-level list, at a time, the GIL
    released between pieces, so no one C call holds it for the whole body (`json.loads` never releases it);
    a top-level list longer than `longest[field]` is refused (400 naming it) before the rest is decoded."""
    try:
        body = _loads_piecewise(raw.decode("utf-8"), longest or {}) if piecewise else json.loads(raw)
    except RecursionError as e:
        raise bad(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from e
    check_json(body, strings=SURROGATE_ESCAPE.search(raw) is not None)
    return body


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _loads_piecewise(text: str, longest: dict[str, int]) -> Any:
    """`json.loads(text)` of a JSON object, its members decoded one by one and a list member element by element."""
    i = _SPACE.match(text).end()
    if not text.startswith("{", i):
        return json.loads(text)
    out, i = {}, _SPACE.match(text, i + 1).end()
    while not text.startswith("}", i):
        if out:
            i = _expect(text, i, ",")
        key, i = _DECODER.raw_decode(text, _SPACE.match(text, i).end())
        if not isinstance(key, str):
            raise ValueError(f"a member name at char {i} is not a string")
        i = _SPACE.match(text, _expect(text, i, ":")).end()
        out[key], i = _value_piecewise(text, i, key, longest.get(key))
        i = _SPACE.match(text, i).end()
        if i >= len(text):
            raise ValueError("unterminated object")
    if text[i + 1:].strip():
        raise ValueError(f"extra data at char {i + 1}")
    return out


def _value_piecewise(text: str, i: int, key: str, limit: int | None) -> tuple[Any, int]:
    if not text.startswith("[", i):
        return _DECODER.raw_decode(text, i)
    out, i = [], _SPACE.match(text, i + 1).end()
    while not text.startswith("]", i):
        if limit is not None and len(out) >= limit:
            raise bad(f"'{key}' holds more than {limit} items; at most {limit} per request", key,
                      "array_above_max_length")
        if out:
            i = _SPACE.match(text, _expect(text, i, ",")).end()
        value, i = _DECODER.raw_decode(text, i)
        out.append(value)
        i = _SPACE.match(text, i).end()
        if i >= len(text):
            raise ValueError("unterminated list")
        if not len(out) % 64:
            time.sleep(0)  # lets the event loop and the generation worker take the GIL
    return out, i + 1


def _expect(text: str, i: int, char: str) -> int:
    i = _SPACE.match(text, i).end()
    if not text.startswith(char, i):
        raise ValueError(f"expected {char!r} at char {i}")
    return i + 1


def check_json(body: Any, strings: bool = True) -> None:
    """Depth at most MAX_JSON_DEPTH and (with `strings`) every string, keys too, valid Unicode: one walk."""
    stack, seen = [(body, 1, None)], 0
    while stack:
        node, depth, top = stack.pop()
        seen += 1
        if not seen % YIELD_EVERY:
            time.sleep(0)  # lets the event loop and the generation worker take the GIL
        if isinstance(node, str):
            if not node.isascii() and LONE_SURROGATE.search(node):
                top = None if top is None else str(top).encode("utf-8", "backslashreplace").decode()
                where = f"'{top}'" if top is not None else "the request body"
                raise bad(f"{where} holds text that is not valid Unicode (a lone surrogate, e.g. \\ud800)", top,
                          "invalid_unicode")
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            key_top = top if top is not None else k
            if strings and isinstance(k, str):
                stack.append((k, depth, key_top))
            if isinstance(v, (dict, list)) or (strings and isinstance(v, str)):
                stack.append((v, depth + 1, key_top))


# ----------------------------------------------------------------------------- fields


def check_body(body, model_name: str) -> None:
    """A request body is a JSON object asking for the served model (or none): else a 400, or a 404 naming it."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(404, f"The model '{model!s:.200}' does not exist; this gateway serves '{model_name}'",
                           code="model_not_found", param="model")


def check_fields(body: dict, honoured, no_effect=frozenset(), refused: dict | None = None) -> None:
    """Refuse (400 naming the field) a field that is neither honoured nor without effect, or a refused one
    (`refused`: field -> (is it the value that asks for nothing, why it is refused otherwise)) set to more."""
    for key, value in body.items():
        if key in honoured or key in no_effect:
            continue
        rule = (refused or {}).get(key)
        if rule is None:
            raise bad(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
        is_default, why = rule
        if not is_default(value):
            raise bad(f"{why} (got {key}={value!r:.200})", key, "unsupported_parameter")


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    """body[key] as a JSON boolean (null or absent: `default`); any other value is a 400 naming it."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be a boolean (true or false), got {value!r:.80}", key, "invalid_type")
    return value


def int_field(body: dict, key: str, lo: int, hi: int | None, default):
    """body[key], an integer in [lo, hi] (no upper bound when hi is None), or `default`; else a 400."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise bad(f"'{key}' must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {value!r:.80}",
                  key)
    return value


def number_field(body: dict, key: str, lo: float, hi: float, default, open_low: bool = False):
    """body[key], a number in [lo, hi] ((lo, hi] with open_low), or `default` when absent; else a 400."""
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi
            or (open_low and value == lo)):
        span = f"({lo}, {hi}]" if open_low else f"[{lo}, {hi}]"
        raise bad(f"'{key}' must be a number in {span}, got {value!r:.80}", key)
    return value


def stop_field(body: dict) -> tuple[str, ...]:
    """`stop`: a string or a list of at most 4 non-empty strings (OpenAI's), as a tuple."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str) and stop:
        return (stop,)
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    raise bad("'stop' must be a non-empty string or a list of at most 4 non-empty strings", "stop")


def sampling_of(body: dict, defaults: SamplingConfig, vocab_size: int | None, max_tokens: int,
                stop: tuple[str, ...], **fixed) -> SamplingConfig:
    """The request's SamplingConfig: temperature, top_p in (0, 1], logit_bias, penalties and min_p in OpenAI's
    ranges (the defaults' where the request leaves them out), `stop` after the generator's own stop strings."""
    out = {key: number_field(body, key, -2, 2, getattr(defaults, key)) for key in ("frequency_penalty",
                                                                              "presence_penalty")}
    try:
        return SamplingConfig(
            max_new_tokens=max_tokens, temperature=number_field(body, "temperature", 0, 2, defaults.temperature),
            do_sample=defaults.do_sample, top_p=number_field(body, "top_p", 0, 1, defaults.top_p, open_low=True),
            top_k=defaults.top_k, min_p=number_field(body, "min_p", 0, 1, defaults.min_p),
            stop=tuple(defaults.stop) + stop, eos_token_ids=defaults.eos_token_ids,
            logit_bias=_logit_bias(body, defaults, vocab_size), **out,
            **{"tool_call_stop": defaults.tool_call_stop, "grammar": defaults.grammar, **fixed})
    except ValueError as e:
        raise bad(str(e)) from e


def _logit_bias(body: dict, defaults: SamplingConfig, vocab_size: int | None):
    """logit_bias: token ids as integer strings (below `vocab_size` when given) to numbers in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return defaults.logit_bias
    if not isinstance(bias, dict):
        raise bad(f"'logit_bias' must be an object of token ids (integer strings) to numbers in [-100, 100], got "
                  f"{bias!r:.80}", "logit_bias")
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad(f"'logit_bias' keys must be token ids written as integer strings, got {key!r:.40}", "logit_bias")
        tok = int(key)
        if vocab_size is not None and tok >= vocab_size:
            raise bad(f"'logit_bias' names token id {tok}, outside this model's vocabulary [0, {vocab_size})",
                      "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias[\"{key}\"]' must be a number in [-100, 100], got {value!r:.40}", "logit_bias")
        if tok in pairs:
            raise bad(f"'logit_bias' names token id {tok} twice", "logit_bias")
        pairs[tok] = float(value)
    return pairs


# ----------------------------------------------------------------------------- the request


@dataclass
class GenRequest:
    """One generation request, whatever route it came by: what the pipeline runs.

    One of: messages (normalized chat messages, planned in their session, encoded by the chat template with
    `tools` and `template_kwargs`, recorded), tokens (prompt ids, planned by id prefix, recorded) or prompts
    (raw text or ids, each sampled `n` times, not recorded). grammar: a `structured.GrammarSpec` (None:
    unconstrained). stop: the request's own stop strings (left out of the text shown). top_logprobs:
    alternatives per sampled token (0: none). session: (name, named by X-Session-Id) when the route chose it
    (a Responses link), else the headers name it. options: the route's own settings, read by its render."""

    sampling: SamplingConfig
    messages: list[dict] | None = None
    tokens: list[int] | None = None
    prompts: list[str | list[int]] | None = None
    tools: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)
    n: int = 1
    seed: int | None = None
    stream: bool = False
    top_logprobs: int = 0
    max_tokens_given: bool = True  # False: max_tokens left out, so the default shrinks to the context left
    stop: tuple[str, ...] = ()
    grammar: Any = None
    session: tuple[str, bool] | None = None
    options: Any = None

    @property
    def recorded(self) -> bool:
        """A conversation or a token prompt: planned in a session and recorded."""
        return self.messages is not None or self.tokens is not None


def check_prompt_size(req: GenRequest, max_context: int | None) -> None:
    """400 (context_length_exceeded) when the prompt is too long to fit even at CHARS_PER_TOKEN characters a
    token: a bound that costs no tokenization. Counts message contents, their tool calls and the tools."""
    if max_context is None or req.tokens is not None:  # token ids: counted exactly when encoded
        return
    if req.prompts is not None:
        sizes = [len(p) for p in req.prompts if isinstance(p, str)]
        chars, param = max(sizes, default=0), "prompt"
    else:
        chars, param = sum(len(t.get("content") or "") + (len(json.dumps(t["tool_calls"])) if t.get("tool_calls")
                                                          else 0) for t in req.messages), "messages"
        chars += len(json.dumps(req.tools)) if req.tools else 0
    limit = max_context * CHARS_PER_TOKEN
    if chars > limit:
        raise bad(f"this model's context is {max_context} tokens; the {param} is {chars} characters, more than "
                  f"{CHARS_PER_TOKEN} characters a token could fit ({limit}): shorten it", param,
                  "context_length_exceeded")


# ----------------------------------------------------------------------------- the reply


@dataclass
class Choice:
    """One sampled reply as the client is shown it: `message` as sampled (recorded), `content` and
    `tool_calls` (OpenAI wire calls) as shown, OpenAI's `finish_reason`, the prompt it answers, and with
    top_logprobs the k most likely (id, log-prob) pairs at each sampled position."""

    index: int
    message: Message
    content: str | None
    tool_calls: list[dict]
    finish_reason: str
    prompt: int = 0
    top: list | None = None


@dataclass
class Result:
    """A finished call: each prompt's ids, the choices (prompt-major, n per prompt), the session it went to."""

    prompt_ids: list[list[int]]
    choices: list[Choice]
    session: Any = None

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompt_ids)
        completion = sum(len(c.message.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class Started:
    """The pipeline's first event: the call is queued for generation, its prompts encoded to these ids."""

    prompt_ids: list[list[int]]


@dataclass
class Finished:
    """The pipeline's last event: the call is done (and recorded, for a conversation)."""

    result: Result


def without_stop(text: str, stops) -> str:
    """The text up to the first of the request's stop strings (OpenAI leaves the stop out of what it returns;
    the recorded ids and MODEL message keep it, as sampled)."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def new_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
