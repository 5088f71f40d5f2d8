"""POST /v1/completions: OpenAI's legacy text completions over the gateway's generator.

A prompt is raw text (or token ids), tokenized as it is, with no chat template, and continued by the
same batched generator as chat requests (`Batcher`, `ModelGenerate.generate_from_ids`). These calls are
not recorded as rollouts: a rollout is a conversation, and a raw prompt has none.

    parse_completion(body, model_name, defaults, tokenizer) -> CompletionRequest   (RequestError -> 4xx)
    text_completion(...) -> the "text_completion" object; stream_chunks(...) -> its stream
"""


import asyncio
import time
import uuid
from dataclasses import dataclass

from SimpleTorchLLMRL.gateway.batcher import Job
from SimpleTorchLLMRL.gateway.limits import CHARS_PER_TOKEN, parse_json, read_body
from SimpleTorchLLMRL.gateway.openai_format import (
    FINISH,
    MAX_N,
    MAX_SEED,
    RequestError,
    bad,
    check_body,
    int_field,
    number_field,
    sampling_controls,
    sse_response,
    top_logprobs,
    without_stop,
)
from SimpleTorchLLMRL.gateway.streaming import Listener, until_disconnect
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig

MAX_PROMPTS = 64
MAX_LOGPROBS = 5  # OpenAI's legacy limit on `logprobs`
# fields of the legacy API this gateway does not honour: refused with a 400 naming them when set to
# anything but their no-op value
REFUSED = {"suffix": (None, ""), "echo": (None, False)}
# every other field it knows: honoured below, or (`user`, `metadata`) accepted without effect; any field not
# here or in REFUSED is refused as OpenAI refuses it, never silently ignored
KNOWN = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "stop", "seed", "stream",
                   "stream_options", "logprobs", "return_token_ids", "logit_bias", "frequency_penalty",
                   "presence_penalty", "min_p", "user", "metadata"})


@dataclass
class CompletionRequest:
    prompts: list[str | list[int]]   # text, or token ids as the client sent them
    sampling: SamplingConfig
    n: int = 1
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    return_token_ids: bool = False


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(body: dict) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [p]
    elif _is_ids(p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        prompts = list(p)
    else:
        raise bad("'prompt' is required: a string, a list of strings, a list of token ids or a list of such lists",
                  "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    if any(x == "" for x in prompts):
        raise bad("'prompt' has an empty string: give text to continue", "prompt")
    return prompts


def parse_completion(body, model_name: str, defaults: SamplingConfig, vocab_size: int | None = None) -> CompletionRequest:
    """Validate a /v1/completions body. Options it leaves out keep the generator's (tool-call stops do not
    apply: a text completion has no tools); logit_bias ids must be below `vocab_size` when given."""
    check_body(body, model_name)
    for key in body:
        if key not in KNOWN and key not in REFUSED:
            raise RequestError(400, f"Unrecognized request argument supplied: {key}", code="unknown_parameter",
                               param=key)
    for key, allowed in REFUSED.items():
        if key in body and body[key] not in allowed:
            raise bad(f"'{key}' is not supported by this gateway's /v1/completions; leave it out", key)
    prompts = _prompts(body)
    n = int_field(body, "n", 1, MAX_N, 1)
    best_of = int_field(body, "best_of", 1, MAX_N, None)
    if best_of is not None and best_of != n:
        raise bad(f"'best_of' other than n is not supported (got best_of={best_of}, n={n}); leave it out",
                  "best_of")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and len(stop) <= 4
                                                           and all(isinstance(s, str) for s in stop))):
        raise bad("'stop' must be a string or a list of at most 4 strings", "stop")
    controls = sampling_controls(body, defaults, vocab_size)
    try:
        sampling = SamplingConfig(
            max_new_tokens=int_field(body, "max_tokens", 1, None, defaults.max_new_tokens),
            temperature=number_field(body, "temperature", 0, 2, defaults.temperature), do_sample=defaults.do_sample,
            top_p=number_field(body, "top_p", 0, 1, defaults.top_p) or None, top_k=defaults.top_k,
            stop=tuple(defaults.stop) + tuple([stop] if isinstance(stop, str) else stop or []),
            eos_token_ids=defaults.eos_token_ids, **controls)
    except ValueError as e:
        raise bad(str(e)) from e
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not set(options) <= {"include_usage", "include_obfuscation"}:
        raise bad(f"'stream_options' must be an object of include_usage and include_obfuscation, got {options!r:.80}",
                  "stream_options")
    return CompletionRequest(prompts=prompts, sampling=sampling, n=n, seed=int_field(body, "seed", 0, MAX_SEED, None),
                             stream=bool(body.get("stream")),
                             include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                             logprobs=int_field(body, "logprobs", 0, MAX_LOGPROBS, None),
                             return_token_ids=bool(body.get("return_token_ids")))


def encode(prompts: list[str | list[int]], tokenizer, max_context: int | None, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's ids (text tokenized as it is, special tokens as the tokenizer adds them, no chat
    template); 400 (context_length_exceeded) when one cannot fit, checked by its length before tokenizing."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if max_context is not None and len(p) > max_context * CHARS_PER_TOKEN:
                raise bad(f"prompt {i} is {len(p)} characters, more than this model's context of {max_context} "
                          f"tokens could hold: shorten it", "prompt", "context_length_exceeded")
            p = tokenizer(p)["input_ids"]
        elif any(t < 0 or t >= len(tokenizer) for t in p):
            raise bad(f"prompt {i} has token ids outside this model's vocabulary [0, {len(tokenizer)})", "prompt")
        if not p:
            raise bad(f"prompt {i} encodes to no tokens", "prompt")
        if max_context is not None and len(p) + max_new_tokens > max_context:
            raise bad(f"this model's context is {max_context} tokens; prompt {i} is {len(p)} tokens and max_tokens "
                      f"is {max_new_tokens}: shorten the prompt or lower max_tokens", "prompt",
                      "context_length_exceeded")
        out.append(list(p))
    return out


def legacy_logprobs(tokenizer, msg, top: list | None) -> dict:
    """OpenAI's legacy `choice.logprobs`: tokens, token_logprobs, top_logprobs (token -> log-prob), text_offset."""
    tokens = [tokenizer.decode([t]) for t in msg.token_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = [{tokenizer.decode([t]): v for t, v in row} for row in top] if top is not None else None
    return {"tokens": tokens, "token_logprobs": list(msg.logprobs), "top_logprobs": tops, "text_offset": offsets}


def text_completion(model: str, choices: list[dict], prompt_ids: list[list[int]], return_token_ids: bool) -> dict:
    completion = sum(len(c["token_ids"]) for c in choices)
    prompt = sum(len(p) for p in prompt_ids)
    out = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
           "model": model,
           "choices": [{k: v for k, v in c.items() if k != "token_ids" or return_token_ids} for c in choices],
           "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    if return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


def stream_chunks(full: dict, include_usage: bool) -> list[dict]:
    """The completion as a stream: one chunk per choice (its text and finish_reason), then usage when asked."""
    base = {k: full[k] for k in ("id", "object", "created", "model")}
    chunks = [{**base, "choices": [c]} for c in full["choices"]]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": full["usage"]})
    return chunks


async def generate(gateway, req: CompletionRequest, prompt_ids: list[list[int]]) -> list:
    """One batcher job per prompt; their messages (or exceptions). Cancelled (the client hung up), the jobs'
    rows stop within a few decode steps, as a chat call's do."""
    jobs = [Job(None, req.sampling, req.n, req.seed, ids, Listener(asyncio.get_running_loop(), stream=False))
            for ids in prompt_ids]
    try:
        return await asyncio.gather(*[gateway.batcher.submit(job) for job in jobs], return_exceptions=True)
    except BaseException:
        for job in jobs:
            job.listener.cancel()
        raise


def completions_route(gateway, error):
    """The FastAPI endpoint of POST /v1/completions over `gateway` (a `Gateway`)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    generator = gateway.generator

    async def completions(request: Request):
        try:
            body = parse_json(await read_body(request, gateway.max_body_bytes))
            req = parse_completion(body, gateway.model_name, gateway.defaults, gateway.vocab_size)
            if req.logprobs and not generator.backend.supports_top_logprobs:
                raise bad("logprobs > 0 needs the HF backend (this gateway runs vLLM); use logprobs: 0", "logprobs")
            prompt_ids = await asyncio.to_thread(encode, req.prompts, generator.tokenizer, generator.max_context,
                                                 req.sampling.max_new_tokens)
            results = await until_disconnect(request, generate(gateway, req, prompt_ids))
            if results is None:  # the client left before its answer was ready: its rows stopped
                return JSONResponse({}, status_code=499)
            for r in results:
                if isinstance(r, ValueError):
                    raise bad(str(r)) from r
                if isinstance(r, BaseException):
                    raise r
            choices = []
            for ids, replies in zip(prompt_ids, results, strict=True):
                for msg in replies:
                    logprobs = None
                    if req.logprobs is not None:
                        top = None
                        if req.logprobs:
                            top = await asyncio.to_thread(top_logprobs, generator, ids, msg, req.logprobs)
                        logprobs = legacy_logprobs(generator.tokenizer, msg, top)
                    text = without_stop(msg.content, req.sampling.stop) if msg.finish_reason == "stop" else msg.content
                    choices.append({"index": len(choices), "text": text, "logprobs": logprobs,
                                    "finish_reason": FINISH.get(msg.finish_reason or "stop", "stop"),
                                    "token_ids": list(msg.token_ids)})
        except RequestError as e:
            return error(e)
        payload = text_completion(gateway.model_name, choices, prompt_ids, req.return_token_ids)
        if not req.stream:
            return JSONResponse(payload)
        return sse_response(stream_chunks(payload, req.include_usage))

    return completions
