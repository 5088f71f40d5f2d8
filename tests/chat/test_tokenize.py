"""Exact token ids and loss masks of encode_rollout for the three template styles.

Expected ids are built from literal strings written out here, not from the
encoder's own template logic, so a wrong header/suffix split fails.
"""

import math

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import as_sampled, collate, encode_prompt, encode_rollout, encode_rollouts

S, U, M, T = MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL, MessageType.TOOL


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def expect(tok, pieces):
    """pieces: (text or list-of-ids, trained) -> (ids, mask)."""
    out_ids, out_mask = [], []
    for piece, trained in pieces:
        p = piece if isinstance(piece, list) else ids(tok, piece)
        out_ids += p
        out_mask += [int(trained)] * len(p)
    return out_ids, out_mask


def check(tok, rollout, pieces):
    enc = encode_rollout(rollout, tok)
    want_ids, want_mask = expect(tok, pieces)
    assert enc.input_ids == want_ids
    assert enc.loss_mask == want_mask
    return enc


# ---------------------------------------------------------------- ChatML


def test_chatml_single_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    r = Rollout([Message("You are helpful.", S), Message("What is 2+2?", U), Message("It is 4.", M)])
    im_end = [tok.convert_tokens_to_ids("<|im_end|>")]
    enc = check(tok, r, [
        ("<|im_start|>system\n", 0), ("You are helpful.", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>user\n", 0), ("What is 2+2?", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>assistant\n", 0), ("It is 4.", 1), (im_end, 1), ("\n", 0),
    ])
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(r.to_chat(), tokenize=False)
    assert enc.sampler_logprobs is None


def test_chatml_multi_turn_with_tool_messages(chatml_tokenizer):
    tok = chatml_tokenizer
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*9"}}\n</tool_call>'
    r = Rollout([Message("Compute 3*9.", U), Message(call, M), Message("27", T), Message("\\boxed{27}", M)])
    im_end = [tok.convert_tokens_to_ids("<|im_end|>")]
    enc = check(tok, r, [
        ("<|im_start|>user\n", 0), ("Compute 3*9.", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>assistant\n", 0), (call, 1), (im_end, 1), ("\n", 0),
        ("<|im_start|>user\n<tool_response>\n", 0), ("27", 0), ("\n</tool_response>", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>assistant\n", 0), ("\\boxed{27}", 1), (im_end, 1), ("\n", 0),
    ])
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(r.to_chat(), tokenize=False)


def test_multi_agent_frozen_model_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    r = Rollout([
        Message("Debate: is 7 prime?", U),
        Message("Yes.", M, name="alice"),
        Message("No.", M, name="bob", trainable=False),
        Message("It is prime.", M, name="alice"),
    ])
    im_end = [tok.convert_tokens_to_ids("<|im_end|>")]
    check(tok, r, [
        ("<|im_start|>user\n", 0), ("Debate: is 7 prime?", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>assistant\n", 0), ("Yes.", 1), (im_end, 1), ("\n", 0),
        ("<|im_start|>assistant\n", 0), ("No.", 0), (im_end, 0), ("\n", 0),
        ("<|im_start|>assistant\n", 0), ("It is prime.", 1), (im_end, 1), ("\n", 0),
    ])


def test_explicitly_trainable_user_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    r = Rollout([Message("teach me", U, trainable=True)])
    im_end = [tok.convert_tokens_to_ids("<|im_end|>")]
    check(tok, r, [("<|im_start|>user\n", 0), ("teach me", 1), (im_end, 1), ("\n", 0)])


# ---------------------------------------------------------------- sampled ids


def test_sampled_ids_used_verbatim_even_when_not_canonical(chatml_tokenizer):
    tok = chatml_tokenizer
    text = "The answer is 56"
    canonical = ids(tok, text)
    # Spell the same text one character at a time: decodes equal, ids differ.
    spelled = [i for ch in text for i in ids(tok, ch)]
    assert spelled != canonical and tok.decode(spelled) == text
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = spelled + [im_end]
    logps = [-0.01 * (k + 1) for k in range(len(sampled))]
    prompt = Rollout([Message("7*8?", U)])
    prompt_ids = encode_prompt(prompt, tok)
    r = prompt.copy().add_messages(Message(text, M, token_ids=sampled, logprobs=logps, temperature=0.7))
    enc = encode_rollout(r, tok)
    # As sampled: the prompt the generator saw, then exactly the sampled ids (the end-of-turn is not doubled).
    assert enc.input_ids == prompt_ids + sampled
    assert enc.loss_mask == [0] * len(prompt_ids) + [1] * len(sampled)
    assert enc.message_index == [-1] * len(prompt_ids) + [1] * len(sampled)
    lp = enc.sampler_logprobs
    assert all(math.isnan(x) for x in lp[: len(prompt_ids)])
    assert lp[len(prompt_ids):] == pytest.approx(logps)
    assert enc.sampling_temperature == 0.7
    # The next turn's prompt continues after the sampled <|im_end|> with the template's own text.
    r.add_messages(Message("And 8*9?", U))
    nxt = encode_prompt(r, tok)
    assert nxt == prompt_ids + sampled + ids(tok, "\n<|im_start|>user\nAnd 8*9?<|im_end|>\n<|im_start|>assistant\n")


def test_truncated_sample_gets_untrained_end_of_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    sampled = ids(tok, "The answer")  # finish_reason="length": no end-of-turn sampled
    prompt = Rollout([Message("q", U)])
    prompt_ids = encode_prompt(prompt, tok)
    r = prompt.copy().add_messages(Message("The answer", M, token_ids=sampled, logprobs=[-1.0] * len(sampled),
                                           finish_reason="length"))
    assert encode_rollout(r, tok).input_ids == prompt_ids + sampled
    # When the episode goes on, the template's end-of-turn the model did not sample is context, not trained.
    r.add_messages(Message("go on", U))
    enc = encode_rollout(r, tok)
    tail = ids(tok, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n")
    assert enc.input_ids == prompt_ids + sampled + tail
    assert enc.loss_mask == [0] * len(prompt_ids) + [1] * len(sampled) + [0] * len(tail)


def test_multi_turn_prefix_invariant(chatml_tokenizer, llama3_tokenizer, plain_tokenizer):
    for tok in (chatml_tokenizer, llama3_tokenizer, plain_tokenizer):
        r = Rollout([Message("Start.", U)])
        eos = tok.eos_token_id
        for turn, text in enumerate(["First reply", "Second reply"]):
            prompt_ids = encode_prompt(r, tok)
            sampled = ids(tok, text) + [eos]
            r.add_messages(Message(text, M, token_ids=sampled, logprobs=[-0.5] * len(sampled)))
            enc = encode_rollout(r, tok)
            assert enc.input_ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled, (tok, turn)
            r.add_messages(Message(f"tool says {turn}", T))


def test_sampled_ids_on_non_model_message_rejected(chatml_tokenizer):
    r = Rollout([Message("q", U, token_ids=[1, 2])])
    with pytest.raises(ValueError, match="only MODEL turns are sampled"):
        encode_rollout(r, chatml_tokenizer)


# ---------------------------------------------------------------- Llama-3


def test_llama3_template_ids_and_masks(llama3_tokenizer):
    tok = llama3_tokenizer
    r = Rollout([Message("Be brief.", S), Message("Hi", U), Message("  Hello there  ", M)])
    eot = [tok.convert_tokens_to_ids("<|eot_id|>")]
    enc = check(tok, r, [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n", 0), ("Be brief.", 0), (eot, 0),
        ("<|start_header_id|>user<|end_header_id|>\n\n", 0), ("Hi", 0), (eot, 0),
        # the template trims content: the trained tokens are the trimmed text
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", 0), ("Hello there", 1), (eot, 1),
    ])
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(r.to_chat(), tokenize=False)


# ---------------------------------------------------------------- no template (GPT-2 style)


def test_plain_concatenation_and_trainable_eos_pad(plain_tokenizer):
    tok = plain_tokenizer
    assert tok.pad_token_id == tok.eos_token_id
    eos = [tok.eos_token_id]
    r = Rollout([Message("Q: 2+2=", U), Message(" 4", M)])
    enc = check(tok, r, [("Q: 2+2=", 0), (" 4", 1), (eos, 1)])
    # After collate, the EOS the model produced stays trainable even though it equals pad.
    batch = collate([enc, encode_rollout(Rollout([Message("Q: 1+1=", U)]), tok)], tok.pad_token_id)
    row = batch.input_ids[0]
    last = int(batch.attention_mask[0].sum()) - 1
    assert row[last] == tok.pad_token_id and batch.loss_mask[0, last] == 1
    assert batch.loss_mask[1].sum() == 0


def test_plain_sampled_ids_verbatim(plain_tokenizer):
    tok = plain_tokenizer
    sampled = [i for ch in " 12" for i in ids(tok, ch)] + [tok.eos_token_id]
    r = Rollout([Message("Q:", U), Message(" 12", M, token_ids=sampled, logprobs=[-0.2] * len(sampled))])
    check(tok, r, [("Q:", 0), (sampled, 1)])


# ---------------------------------------------------------------- lengths, batches


def test_max_length_error_and_explicit_truncation(chatml_tokenizer):
    tok = chatml_tokenizer
    r = Rollout([Message("a long question " * 5, U), Message("reply", M)])
    n = len(encode_rollout(r, tok))
    with pytest.raises(ValueError, match=f"encodes to {n} tokens, over max_length=10"):
        encode_rollout(r, tok, max_length=10)
    cut = encode_rollout(r, tok, max_length=10, truncate=True)
    full = encode_rollout(r, tok)
    assert cut.input_ids == full.input_ids[:10] and cut.loss_mask == full.loss_mask[:10]
    with pytest.raises(ValueError, match=r"\(rollout 1\)"):
        encode_rollouts([Rollout([Message("x", U)]), r], tok, max_length=10)


def test_batched_encoding_equals_one_at_a_time(any_tokenizer):
    tok = any_tokenizer
    rollouts = [
        Rollout([Message("sys", S), Message(f"question {i}", U), Message(f"answer {i * 7}", M),
                 Message("tool out", T), Message("final", M, trainable=i % 2 == 0)])
        for i in range(5)
    ]
    batched = encode_rollouts(rollouts, tok)
    assert batched == [encode_rollout(r, tok) for r in rollouts]


def test_collate_shapes_padding_and_logprobs(chatml_tokenizer):
    tok = chatml_tokenizer
    a = encode_rollout(Rollout([Message("short", U), Message("x", M, token_ids=[5, 6], logprobs=[-1.0, -2.0])]), tok,
                       check_ids=False)  # ids made up for the test
    b = encode_rollout(Rollout([Message("a much longer question here", U), Message("y", M)]), tok)
    batch = collate([a, b], tok.pad_token_id)
    B, Tn = batch.input_ids.shape
    assert (B, Tn) == (2, max(len(a), len(b)))
    for t in (batch.attention_mask, batch.loss_mask, batch.sampler_logprobs):
        assert t.shape == (2, Tn)
    assert batch.attention_mask[0].tolist() == [1] * len(a) + [0] * (Tn - len(a))
    assert batch.input_ids[0, len(a):].eq(tok.pad_token_id).all()
    assert batch.loss_mask[0].tolist() == a.loss_mask + [0] * (Tn - len(a))
    got = batch.sampler_logprobs[0, : len(a)]
    want = torch.tensor([float("nan") if x != x else x for x in a.sampler_logprobs])
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.allclose(got.nan_to_num(), want.nan_to_num())
    assert torch.isnan(batch.sampler_logprobs[1]).all()
    assert batch.num_tokens == sum(a.loss_mask) + sum(b.loss_mask)
    sub = batch[1]
    assert sub.input_ids.shape == (1, Tn) and torch.equal(sub.loss_mask[0], batch.loss_mask[1])
    padded = collate([a, b], tok.pad_token_id, pad_to_multiple_of=16)
    assert padded.input_ids.shape[1] % 16 == 0


def test_collate_errors():
    with pytest.raises(ValueError, match="at least one"):
        collate([], 0)


def test_mixed_sampling_temperatures_rejected(chatml_tokenizer):
    r = Rollout([Message("q", U), Message("a", M, token_ids=[5], logprobs=[-1.0], temperature=1.0),
                 Message("b", M, token_ids=[6], logprobs=[-1.0], temperature=0.5)])
    with pytest.raises(ValueError, match="mixes sampling temperatures"):
        encode_rollout(r, chatml_tokenizer, check_ids=False)  # ids made up for the test


def _with_template(template: str):
    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    tok.chat_template = template
    return tok


CHATML_TURN = "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
GEN = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"


def test_template_dropping_tool_messages_is_named():
    tok = _with_template("{% for m in messages %}{% if m.role != 'tool' %}" + CHATML_TURN + "{% endif %}{% endfor %}"
                         + GEN)
    r = Rollout([Message("q", U), Message("call", M), Message("result 27", T), Message("It is 27.", M)])
    with pytest.raises(ValueError, match="drops TOOL messages"):
        encode_rollout(r, tok)
    sampled = Rollout([Message("q", U), Message("call", M, token_ids=ids(tok, "call") + [tok.eos_token_id]),
                       Message("27", T)])
    with pytest.raises(ValueError, match="drops TOOL messages"):
        encode_prompt(sampled, tok)


def test_template_stripping_reasoning_is_named_for_hand_written_turns_only():
    strip = ("{% for m in messages %}{% set c = m.content %}{% if m.role == 'assistant' and not loop.last %}"
             "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<|im_start|>' + m.role + '\\n' + c + "
             "'<|im_end|>\\n' }}{% endfor %}" + GEN)
    tok = _with_template(strip)
    r = Rollout([Message("q", U), Message("<think>hmm</think>five", M), Message("again", U), Message("six", M)])
    with pytest.raises(ValueError, match=r"message 1 \(assistant\): the chat template strips the reasoning"):
        encode_rollout(r, tok)
    # As sampled, the turn is what the model produced; later prompts never re-render it.
    first = Rollout([Message("q", U)])
    p1 = encode_prompt(first, tok)
    s1 = ids(tok, "<think>hmm</think>five") + [tok.eos_token_id]
    first.add_messages(Message("<think>hmm</think>five", M, token_ids=s1), Message("again", U))
    assert encode_prompt(first, tok)[: len(p1) + len(s1)] == p1 + s1


def test_template_rejecting_role_order_is_named():
    tok = _with_template("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}"
                         "{% endif %}" + CHATML_TURN + "{% endfor %}" + GEN)
    with pytest.raises(ValueError, match=r"rejects the conversation \[user, assistant, tool\]: no tools here"):
        encode_rollout(Rollout([Message("q", U), Message("a", M), Message("r", T)]), tok)


def test_turn_closed_by_another_special_token_trains_that_token():
    # Agent "bob" turns close with <|endoftext|>, which no probe of a plain assistant turn shows.
    tok = _with_template("{% for m in messages %}{% if m.name == 'bob' %}"
                         "{{ '<|im_start|>assistant\\n' + m.content + '<|endoftext|>' }}{% else %}" + CHATML_TURN
                         + "{% endif %}{% endfor %}" + GEN)
    r = Rollout([Message("q", U), Message("mine", M, name="bob"), Message("next", U), Message("ok", M)])
    enc = encode_rollout(r, tok)
    trained = tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])
    assert trained == "mine<|endoftext|>ok<|im_end|>"


def test_turn_whose_end_cannot_be_found_is_refused_not_mis_masked():
    # Tool-call turns end with plain text, so the first end-of-turn after them is inside the tool result.
    tok = _with_template("{% for m in messages %}{% if m.tool_calls %}{{ '<|im_start|>assistant\\n<call>' + "
                         "m.tool_calls[0].function.name + '</call>' }}{% else %}" + CHATML_TURN + "{% endif %}"
                         "{% endfor %}" + GEN)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*9"}}}
    r = Rollout([Message("q", U), Message("", M, tool_calls=[call]), Message("27", T), Message("ok", M)])
    with pytest.raises(ValueError, match="not one of its end-of-turn tokens"):
        encode_rollout(r, tok)


def test_structured_tool_calls_are_trained_with_the_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    call = {"type": "function", "id": "c1", "function": {"name": "calculator", "arguments": {"expression": "3*9"}}}
    r = Rollout([Message("Compute 3*9.", U), Message("Let me compute.", M, tool_calls=[call]),
                 Message("27", T, tool_call_id="c1"), Message("27.", M)])
    text = tok.apply_chat_template(r.to_chat(), tokenize=False)
    enc = encode_rollout(r, tok)
    assert enc.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    trained = tok.decode([i for i, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])
    want = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*9"}}\n'
            '</tool_call><|im_end|>27.<|im_end|>')
    assert trained == want
    assert r.to_chat()[2]["tool_call_id"] == "c1"


def test_as_sampled_turns_hand_written_replies_into_sampled_ids(chatml_tokenizer):
    tok = chatml_tokenizer
    r = Rollout([Message("What is 2+2?", U), Message("It is 4.", M)])
    enc = encode_rollout(as_sampled(r, tok), tok)
    want = encode_prompt(Rollout([Message("What is 2+2?", U)]), tok) + ids(tok, "It is 4.") + ids(tok, "<|im_end|>")
    assert enc.input_ids == want
    assert sum(enc.loss_mask) == len(ids(tok, "It is 4.")) + 1
    assert r[1].token_ids is None  # the original is untouched


def test_trainable_message_after_a_sampled_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    sampled = ids(tok, "Hi.") + ids(tok, "<|im_end|>")
    r = Rollout([Message("q", U), Message("Hi.", M, token_ids=sampled), Message("frozen", M, trainable=False),
                 Message("teach me", U, trainable=True)])
    enc = encode_rollout(r, tok)
    trained = [(i, x) for i, x, m in zip(enc.message_index, enc.input_ids, enc.loss_mask, strict=True) if m]
    assert [x for _, x in trained] == sampled + ids(tok, "teach me") + ids(tok, "<|im_end|>")
    assert [i for i, _ in trained] == [1] * len(sampled) + [3] * (len(trained) - len(sampled))


def test_encoding_from_two_threads_at_once(chatml_tokenizer):
    """A rollout producer thread and the trainer share the template's memo."""
    from concurrent.futures import ThreadPoolExecutor

    tok = chatml_tokenizer
    rollouts = [Rollout([Message(f"question {i}", U), Message(f"answer {i}", M, token_ids=ids(tok, f"answer {i}")),
                         Message(f"tool {i % 7}", T)]) for i in range(3000)]
    want = [encode_prompt(r, tok) for r in rollouts]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: encode_prompt(r, tok), rollouts))
    assert got == want
