"""Encoding speed: 1,000 four-turn rollouts -> ids, masks, log-probs, collated batch.

A four-turn rollout here: system, user, then four MODEL turns (sampled ids and
log-probs, as the generator leaves them) each followed by a TOOL result but the
last: 9 messages. Goal: under 2 s for 1,000 on a 2-core CPU.
`--hand-written` drops the sampled ids: the canonical path (whole conversation
rendered, trained turns located in it).

    uv run python benchmarks/encode.py [--hand-written]
"""

import argparse
import time

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import collate, encode_rollouts
from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer


def make_rollouts(tok, n, hand_written=False):
    eot = tok.eos_token_id
    rollouts = []
    for i in range(n):
        r = Rollout([Message("You are a careful assistant with a calculator.", MessageType.SYSTEM),
                     Message(f"What is {i} * {i + 7} + {3 * i}?", MessageType.MESSAGE)])
        for turn in range(4):
            text = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{i} * {turn + 7}"}}}}</tool_call>'
            sampled = tok(text, add_special_tokens=False)["input_ids"] + [eot]
            if hand_written:  # no token_ids: the whole conversation is rendered and trained turns located
                r.add_messages(Message(text, MessageType.MODEL))
            else:
                r.add_messages(Message(text, MessageType.MODEL, token_ids=sampled,
                                       logprobs=[-0.5] * len(sampled), temperature=1.0))
            if turn < 3:
                r.add_messages(Message(str(i * (turn + 7)), MessageType.TOOL))
        rollouts.append(r)
    return rollouts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hand-written", action="store_true", help="MODEL turns without sampled ids")
    args = p.parse_args()
    for style in ("chatml", "llama3", "plain"):
        tok = tiny_tokenizer(style)
        rollouts = make_rollouts(tok, args.n, args.hand_written)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            enc = encode_rollouts(rollouts, tok)
            batch = collate(enc, tok.pad_token_id)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"{style:7s} {args.n} rollouts x {len(rollouts[0])} messages: median {times[len(times) // 2]:.3f} s "
              f"(min {times[0]:.3f}), batch {tuple(batch.input_ids.shape)}, trained tokens {batch.num_tokens}")


if __name__ == "__main__":
    main()
