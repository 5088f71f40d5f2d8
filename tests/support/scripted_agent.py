"""A scripted stand-in for the generator: replies are fixed text, encoded like sampled tokens.

    rollout, done = run_scripted(env, "What is 3 * 9?", "27", ["<tool_call>...</tool_call>", "\\boxed{27}"], tok)

Each reply becomes a MODEL message with `token_ids` (the text's ids plus the EOS
id, as a generator that sampled EOS would record) and constant log-probs, so
`encode_rollout` treats it exactly like a generated turn.
"""

import math

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout

LOGPROB = -0.25


def model_message(text, tokenizer=None):
    if tokenizer is None:
        return Message(text, MessageType.MODEL)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Message(text, MessageType.MODEL, token_ids=ids, logprobs=[LOGPROB] * len(ids), temperature=1.0,
                   finish_reason="stop")


def run_scripted(env, question, answer, replies, tokenizer=None):
    """Drive `env` like collect_rollouts does, with `replies` as the MODEL turns; returns (rollout, done)."""
    msgs, state = env.setup(question, answer)
    meta = {"env_state": state, "answer": answer}
    if env.tools is not None:
        meta["tools"] = env.tools
    rollout = Rollout(msgs, meta)
    done = False
    for reply in replies:
        rollout.add_messages(model_message(reply, tokenizer))
        new, done = env.step(rollout, state)
        rollout.add_messages(*new)
        if done:
            break
    return rollout, done


class ScriptedGenerator:
    """`batch_rollout_generate_response` for collect_rollouts: replies[question][turn]."""

    def __init__(self, replies, tokenizer=None):
        self.replies, self.tokenizer = replies, tokenizer

    def batch_rollout_generate_response(self, rollouts):
        for r in rollouts:
            turn = sum(m.type is MessageType.MODEL for m in r)
            script = self.replies[r.metadata["question"]]
            r.add_messages(model_message(script[min(turn, len(script) - 1)], self.tokenizer))


def assert_only_model_turns_trained(rollout, tok):
    """loss_mask is 1 exactly on the MODEL turns' sampled ids; each MODEL turn extends its own prompt."""
    enc = encode_rollout(rollout, tok)
    trained = [t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m]
    assert trained == [t for m in rollout if m.type is MessageType.MODEL for t in m.token_ids]
    assert [not math.isnan(x) for x in enc.sampler_logprobs] == [bool(m) for m in enc.loss_mask]
    assert {x for x in enc.sampler_logprobs if not math.isnan(x)} == {LOGPROB}
    for k, msg in enumerate(rollout):
        if msg.type is MessageType.MODEL:
            prompt = encode_prompt(Rollout(rollout[:k], rollout.metadata), tok)
            assert enc.input_ids[: len(prompt) + len(msg.token_ids)] == prompt + msg.token_ids
    untrained = tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if not m])
    for msg in rollout:
        if msg.type is MessageType.TOOL:
            assert msg.content.strip() in untrained
