"""POST /inference/v1/generate (vLLM's token-in/token-out route) at the two ends of the pipeline, `parse` and
`render`, and its session plan by id prefix (`plan_ids`; docs/gateway.md, "Token sessions").
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from SimpleTorchLLMRL.chat.message import Message, MessageType
from SimpleTorchLLMRL.gateway.request import (
    FINISH,
    MAX_N,
    MAX_SEED,
    GenRequest,
    RequestError,
    Result,
    bad,
    bool_field,
    check_body,
    check_fields,
    int_field,
    sampling_of,
    stop_field,
)

TOKENS = "token_ids"  # the session options of a token call: it merges only onto a token call
HONOURED = frozenset({"model", "token_ids", "sampling_params", "request_id", "return_token_ids"})
NO_EFFECT = frozenset({"cache_salt"})  # a prefix-cache salt: this gateway keeps no cache across requests
REFUSED = {
    "stream": (lambda v: v in (None, False), "streaming is not supported on /inference/v1/generate"),
    "priority": (lambda v: v in (None, 0), "request priorities are not supported"),
    "output_mode": (lambda v: v in (None, "tokens"), "only output_mode 'tokens' is supported"),
    **{key: (lambda v: v is None, f"'{key}' is not supported") for key in (
        "features", "content_parts", "stream_options", "kv_transfer_params", "ec_transfer_params",
        "reasoning_ended", "reasoning_parser_kwargs", "token_offsets")},
}
SAMPLING_HONOURED = frozenset({"n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids",
                               "seed", "logit_bias", "frequency_penalty", "presence_penalty"})
# they shape the text vLLM would detokenize, or tag the request: this route returns ids only
SAMPLING_NO_EFFECT = frozenset({"skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                                "detokenize", "routed_experts_prompt_start"})
SAMPLING_REFUSED = {
    "logprobs": (lambda v: v in (None, 0, 1), "top log-probs are not returned: the sampled token's log-prob always is "
                                              "(logprobs 0 or 1)"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "repetition_penalty is not supported"),
    "min_tokens": (lambda v: v in (None, 0), "min_tokens is not supported"),
    "ignore_eos": (lambda v: v in (None, False), "ignore_eos is not supported"),
    **{key: (lambda v: v is None, f"'{key}' is not supported") for key in (
        "prompt_logprobs", "structured_outputs", "guided_decoding", "bad_words", "allowed_token_ids",
        "logits_processors", "truncate_prompt_tokens", "extra_args")},
}


@dataclass(frozen=True)
class TokenOptions:
    request_id: str
    return_token_ids: bool = False


@contextlib.contextmanager
def _inside(field: str):
    """A 400 raised for a key of a nested object names it as `field.key`."""
    try:
        yield
    except RequestError as e:
        if e.param is not None and not e.param.startswith(f"{field}."):
            e.param = f"{field}.{e.param}"
        raise


def _ids(value, vocab: int, field: str) -> list[int]:
    """A non-empty list of token ids in [0, vocab)."""
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise bad(f"'{field}' must be a non-empty list of token ids (integers)", field)
    if not all(0 <= t < vocab for t in value):
        raise bad(f"'{field}' has token ids outside this model's vocabulary [0, {vocab})", field)
    return value


def parse(body: Any, ctx) -> GenRequest:
    """A /inference/v1/generate body as a `GenRequest` of token ids. Options it leaves out keep the generator's
    (its stop strings apply; tool-call stops do not: the client parses its own calls); `stop_token_ids` end a
    reply as the generator's EOS ids do."""
    check_body(body, ctx.model_name)
    check_fields(body, HONOURED, NO_EFFECT, REFUSED)
    ids = _ids(body.get("token_ids"), ctx.vocab_size, "token_ids")
    request_id = body.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= 256):
        raise bad("'request_id' must be a string of 1 to 256 characters", "request_id")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad("'sampling_params' must be an object", "sampling_params")
    with _inside("sampling_params"):
        check_fields(params, SAMPLING_HONOURED, SAMPLING_NO_EFFECT, SAMPLING_REFUSED)
        given = params.get("stop_token_ids")
        stop_ids = [] if given is None or given == [] else _ids(given, ctx.vocab_size, "stop_token_ids")
        top_k = int_field(params, "top_k", -1, None, ctx.defaults.top_k)  # vLLM's -1 and 0: off
        max_tokens = int_field(params, "max_tokens", 1, None, None)
        stop = stop_field(params)
        sampling = dataclasses.replace(
            sampling_of(params, ctx.defaults, ctx.vocab_size, max_tokens or ctx.defaults.max_new_tokens, stop,
                        tool_call_stop=(), grammar=None),
            top_k=top_k if top_k and top_k > 0 else None,
            eos_token_ids=tuple(dict.fromkeys([*ctx.defaults.eos_token_ids, *stop_ids])))
        n, seed = int_field(params, "n", 1, MAX_N, 1), int_field(params, "seed", 0, MAX_SEED, None)
    return GenRequest(sampling=sampling, tokens=ids, n=n, seed=seed, max_tokens_given=max_tokens is not None,
                      stop=stop, options=TokenOptions(request_id or uuid.uuid4().hex,
                                                      bool_field(body, "return_token_ids")))


def render(result: Result, req: GenRequest, ctx) -> dict:
    """vLLM's token response: each choice's sampled ids, their log-probs, and OpenAI's finish_reason."""
    opts: TokenOptions = req.options
    choices = [{"index": c.index, "token_ids": list(c.message.token_ids),
                "finish_reason": FINISH[c.message.finish_reason or "stop"],
                "logprobs": {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp}
                                         for t, lp in zip(c.message.token_ids, c.message.logprobs, strict=True)]}}
               for c in result.choices]
    out = {"request_id": opts.request_id, "model": ctx.model_name, "choices": choices, "usage": result.usage()}
    if opts.return_token_ids:
        out["prompt_token_ids"] = result.prompt_ids[0]
    return out


# ----------------------------------------------------------------------------- the session plan, by ids


def continued(branch, ids: list[int]) -> int | None:
    """The reply of a token branch (`sessions.Branch`) that `ids` continue: they start with its prompt, then that
    reply's sampled ids. None when they continue none (or the branch is a conversation's)."""
    if branch is None or branch.options != TOKENS:
        return None
    prompt = branch.views[0]
    n = len(prompt)
    if len(ids) < n or ids[n - 1] != prompt[-1] or tuple(ids[:n]) != prompt:  # the cheap test first
        return None
    return next((j for j, shown in enumerate(branch.shown) if tuple(ids[n:n + len(shown)]) == shown), None)


def context_ids(ids: list[int]) -> list[Message]:
    """Prompt ids sent as ids, as the context message that carries them (none for no ids); the gateway fills in
    its text off the event loop (`Gateway._encode`)."""
    return [Message("", MessageType.MESSAGE, token_ids=list(ids), trainable=False)] if ids else []


def plan_ids(branch, ids: list[int]) -> tuple[list[Message], list, bool]:
    """A token call's plan on its session's branch: (the prompt's messages, the rollouts it closes, merged).
    Merged: the branch's messages, the continued reply, the new ids; the other replies are closed. Forked: the
    ids as one context message; every reply of the branch is closed."""
    j = continued(branch, ids)
    if j is None:
        return context_ids(ids), branch.rollouts() if branch is not None else [], False
    at = len(branch.views[0]) + len(branch.shown[j])
    closed = [branch.rollout(i) for i in range(len(branch.replies)) if i != j]
    return [*branch.prompt.messages, branch.replies[j], *context_ids(ids[at:])], closed, True
