"""POST /v1/completions (OpenAI's legacy text completions) at the two ends of the pipeline: `parse` and `render`.
A raw prompt (text or ids), no chat template, not recorded (docs/gateway.md, "Text completions").
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.gateway.request import (
    MAX_N,
    MAX_SEED,
    GenRequest,
    Result,
    bad,
    bool_field,
    check_body,
    check_fields,
    int_field,
    sampling_of,
    stop_field,
)

MAX_PROMPTS = 64
MAX_LOGPROBS = 5  # OpenAI's legacy limit on `logprobs`
# fields of the legacy API this gateway does not honour: refused with a 400 naming them unless they ask for nothing
REFUSED = {"suffix": (lambda v: v in (None, ""), "'suffix' is not supported by this gateway's /v1/completions"),
           "echo": (lambda v: v in (None, False), "'echo' is not supported by this gateway's /v1/completions")}
# every other field it knows: honoured, or (`user`, `metadata`) accepted without effect
HONOURED = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed",
                      "stream", "stream_options", "logprobs", "return_token_ids", "logit_bias", "frequency_penalty",
                      "presence_penalty", "min_p"})
NO_EFFECT = frozenset({"user", "metadata"})


@dataclass(frozen=True)
class CompletionOptions:
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    return_token_ids: bool = False


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(body: dict, vocab: int) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids (in the vocabulary), or a list of such lists."""
    p = body.get("prompt")
    if isinstance(p, str) or _is_ids(p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        prompts = list(p)
    else:
        raise bad("'prompt' is required: a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    for i, x in enumerate(prompts):
        if x == "":
            raise bad("'prompt' has an empty string: give text to continue", "prompt")
        if isinstance(x, list) and any(t < 0 or t >= vocab for t in x):
            raise bad(f"prompt {i} has token ids outside this model's vocabulary [0, {vocab})", "prompt")
    return prompts


def parse(body: Any, ctx) -> GenRequest:
    """A /v1/completions body as a `GenRequest`. Options it leaves out keep the generator's (tool-call stops do
    not apply: a text completion has no tools)."""
    check_body(body, ctx.model_name)
    check_fields(body, HONOURED, NO_EFFECT, REFUSED)
    prompts = _prompts(body, len(ctx.tokenizer))
    n = int_field(body, "n", 1, MAX_N, 1)
    best_of = int_field(body, "best_of", 1, MAX_N, None)
    if best_of is not None and best_of != n:
        raise bad(f"'best_of' other than n is not supported (got best_of={best_of}, n={n}); leave it out", "best_of")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
        raise bad(f"'stream_options' must be an object of include_usage and include_obfuscation, got {options!r:.80}",
                  "stream_options")
    logprobs = int_field(body, "logprobs", 0, MAX_LOGPROBS, None)
    if logprobs and not ctx.supports_top_logprobs:
        raise bad("logprobs > 0 needs the HF backend (this gateway runs vLLM); use logprobs: 0", "logprobs")
    max_tokens = int_field(body, "max_tokens", 1, None, None)
    stop = stop_field(body)
    sampling = sampling_of(body, ctx.defaults, ctx.vocab_size, max_tokens or ctx.defaults.max_new_tokens, stop,
                           tool_call_stop=(), grammar=None)
    return GenRequest(sampling=sampling, prompts=prompts, n=n, seed=int_field(body, "seed", 0, MAX_SEED, None),
                      top_logprobs=logprobs or 0, max_tokens_given=max_tokens is not None, stop=stop,
                      options=CompletionOptions(bool_field(body, "stream"), bool_field(options, "include_usage"),
                                                logprobs, bool_field(body, "return_token_ids")))


def legacy_logprobs(tokenizer, msg, top: list | None) -> dict:
    """OpenAI's legacy `choice.logprobs`: tokens, token_logprobs, top_logprobs (token -> log-prob), text_offset."""
    tokens = [tokenizer.decode([t]) for t in msg.token_ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
    tops = [{tokenizer.decode([t]): v for t, v in row} for row in top] if top is not None else None
    return {"tokens": tokens, "token_logprobs": list(msg.logprobs), "top_logprobs": tops, "text_offset": offsets}


def render(result: Result, req: GenRequest, ctx):
    """The "text_completion" object (or, for a stream, its chunks: one per choice, then usage when asked)."""
    opts: CompletionOptions = req.options
    choices = []
    for c in result.choices:
        out = {"index": c.index, "text": c.content or "", "finish_reason": c.finish_reason,
               "logprobs": None if opts.logprobs is None else legacy_logprobs(ctx.tokenizer, c.message, c.top)}
        if opts.return_token_ids:
            out["token_ids"] = list(c.message.token_ids)
        choices.append(out)
    full = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": ctx.model_name, "choices": choices, "usage": result.usage()}
    if opts.return_token_ids:
        full["prompt_token_ids"] = result.prompt_ids
    if not opts.stream:
        return full
    from SimpleTorchLLMRL.gateway.streaming import sse_stream

    base = {k: full[k] for k in ("id", "object", "created", "model")}
    chunks = [{**base, "choices": [c]} for c in full["choices"]]
    if opts.include_usage:
        chunks.append({**base, "choices": [], "usage": full["usage"]})

    async def each():
        for c in chunks:
            yield c

    return sse_stream(each(), ctx.error_body)
