"""Exact token ids and loss masks of encode_rollout for the three template styles.

Expected ids are built from literal strings written out here, not from the
encoder's own template logic, so a wrong header/suffix split fails.
"""

import math

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import collate, encode_prompt, encode_rollout, encode_rollouts

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
    assert enc.old_logprobs is None


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
    # The invariant: prompt ids + sampled ids are a prefix of the encoding.
    assert enc.input_ids[: len(prompt_ids) + len(sampled)] == prompt_ids + sampled
    # The sampled end-of-turn token is not duplicated: only the template's "\n" follows.
    assert enc.input_ids[len(prompt_ids) + len(sampled):] == ids(tok, "\n")
    assert enc.loss_mask == [0] * len(prompt_ids) + [1] * len(sampled) + [0]
    lp = enc.old_logprobs
    assert all(math.isnan(x) for x in lp[: len(prompt_ids)]) and math.isnan(lp[-1])
    assert lp[len(prompt_ids): len(prompt_ids) + len(sampled)] == pytest.approx(logps)
    assert enc.sampling_temperature == 0.7
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(r.to_chat(), tokenize=False)


def test_truncated_sample_gets_untrained_end_of_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    sampled = ids(tok, "The answer")  # finish_reason="length": no end-of-turn sampled
    prompt = Rollout([Message("q", U)])
    prompt_ids = encode_prompt(prompt, tok)
    r = prompt.copy().add_messages(Message("The answer", M, token_ids=sampled, logprobs=[-1.0] * len(sampled),
                                           finish_reason="length"))
    enc = encode_rollout(r, tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert enc.input_ids == prompt_ids + sampled + [im_end] + ids(tok, "\n")
    assert enc.loss_mask == [0] * len(prompt_ids) + [1] * len(sampled) + [0, 0]


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
    a = encode_rollout(Rollout([Message("short", U), Message("x", M, token_ids=[5, 6], logprobs=[-1.0, -2.0])]), tok)
    b = encode_rollout(Rollout([Message("a much longer question here", U), Message("y", M)]), tok)
    batch = collate([a, b], tok.pad_token_id)
    B, Tn = batch.input_ids.shape
    assert (B, Tn) == (2, max(len(a), len(b)))
    for t in (batch.attention_mask, batch.loss_mask, batch.old_logprobs):
        assert t.shape == (2, Tn)
    assert batch.attention_mask[0].tolist() == [1] * len(a) + [0] * (Tn - len(a))
    assert batch.input_ids[0, len(a):].eq(tok.pad_token_id).all()
    assert batch.loss_mask[0].tolist() == a.loss_mask + [0] * (Tn - len(a))
    got = batch.old_logprobs[0, : len(a)]
    want = torch.tensor([float("nan") if x != x else x for x in a.old_logprobs])
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.allclose(got.nan_to_num(), want.nan_to_num())
    assert torch.isnan(batch.old_logprobs[1]).all()
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
        encode_rollout(r, chatml_tokenizer)


def test_prefix_unstable_template_is_named():
    from SimpleTorchLLMRL.tiny import tiny_tokenizer

    tok = tiny_tokenizer("chatml")
    # A template that only shows the last message is not prefix-stable.
    tok.chat_template = "{{ messages[-1].content }}"
    with pytest.raises(ValueError, match="not prefix-stable at message 1"):
        encode_rollout(Rollout([Message("one", U), Message("two", M)]), tok)
