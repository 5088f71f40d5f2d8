"""Constrained decoding (`SamplingConfig.grammar`, `model/generation/constrain.py`) on the HF loops.

Every completion stays inside its grammar, greedy equals a naive masked-argmax loop, the fast loop asked
for falls back to the default one (same ids under a seed), recorded log-probs are the raw
log_softmax(logits / T) of a float64 forward (before the mask), and every sampled JSON validates.
"""

import json

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from SimpleTorchLLMRL import ModelGenerate  # noqa: E402
from SimpleTorchLLMRL.chat.message import Rollout  # noqa: E402
from SimpleTorchLLMRL.chat.tokenize import encode_prompt  # noqa: E402
from SimpleTorchLLMRL.model.generation.constrain import compiled_grammar, json_schema_grammar  # noqa: E402
from SimpleTorchLLMRL.model.generation.generator import BackendConfig  # noqa: E402
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig  # noqa: E402
from tests.support.gateway_helpers import start  # noqa: E402
from tests.support.generation_helpers import reference_logprobs  # noqa: E402

ANSWER = 'root ::= "The answer is " [0-9]{1,3} ("." | " apples.")'
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


def rollouts(k: int = 2) -> list[Rollout]:
    qs = ["What is 645 * 49?", "Give a name and an age as JSON."]
    return [Rollout.from_chat(start(q)) for q in qs[:k]]


def in_grammar(tok, ids: list[int], grammar: str, eos: int) -> bool:
    """Whether a fresh matcher accepts exactly `ids` and ends terminated on their final EOS."""
    m = xgr.GrammarMatcher(compiled_grammar(tok, 2304, grammar), override_stop_tokens=[eos])
    return all(m.accept_token(t) for t in ids) and m.is_terminated()


def test_every_sampled_completion_matches_the_grammar(calc):
    model, tok = calc
    gen = ModelGenerate(model, tok, max_new_tokens=24, temperature=1.5, seed=0)
    cfg = SamplingConfig(max_new_tokens=24, temperature=1.5, grammar=ANSWER)
    import re

    for group in gen.generate(rollouts(), n=8, sampling=cfg):
        for m in group:
            assert m.finish_reason == "stop" and m.token_ids[-1] == tok.eos_token_id
            assert re.fullmatch(r"The answer is [0-9]{1,3}(\.| apples\.)", m.content), m.content
            assert in_grammar(tok, m.token_ids, ANSWER, tok.eos_token_id)
    # the same model without the grammar writes something else
    free = gen.generate(rollouts(1), n=4, sampling=SamplingConfig(max_new_tokens=24, temperature=1.5))
    assert not any(m.content.startswith("The answer is ") for m in free[0])


def test_greedy_is_the_argmax_over_the_tokens_the_grammar_allows(calc):
    model, tok = calc
    [r] = rollouts(1)
    [[m]] = ModelGenerate(model, tok, sampling=SamplingConfig(max_new_tokens=16, do_sample=False)).generate(
        [r], sampling=SamplingConfig(max_new_tokens=16, do_sample=False, grammar=ANSWER))
    # naive reference: a full forward per step, the matcher's mask, the argmax
    ids = encode_prompt(r, tok)
    matcher = xgr.GrammarMatcher(compiled_grammar(tok, 2304, ANSWER), override_stop_tokens=[tok.eos_token_id])
    bitmask = xgr.allocate_token_bitmask(1, 2304)
    want = []
    while not matcher.is_terminated() and len(want) < 16:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + want])).logits[:, -1].float()  # (1, V)
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        want.append(int(logits.argmax(-1)))
        assert matcher.accept_token(want[-1])
    assert m.token_ids == want and want[-1] == tok.eos_token_id


def test_the_fast_loop_asked_for_falls_back_with_the_same_ids(calc, monkeypatch):
    from SimpleTorchLLMRL.model.generation.hf_backend import HFBackend

    model, tok = calc
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.2, grammar=json_schema_grammar(SCHEMA))
    default = ModelGenerate(model, tok,
                            backend=BackendConfig(decode="default")).generate(rollouts(), n=3, sampling=cfg, seed=7)
    fast = ModelGenerate(model, tok, backend=BackendConfig(decode="fast"))

    def no_fast(*a, **k):
        raise AssertionError("a grammar call must not take the fast decode")

    monkeypatch.setattr(HFBackend, "_fast_decode", no_fast)
    again = fast.generate(rollouts(), n=3, sampling=cfg, seed=7)
    assert [[m.token_ids for m in g] for g in again] == [[m.token_ids for m in g] for g in default]
    assert [[m.logprobs for m in g] for g in again] == [[m.logprobs for m in g] for g in default]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_recorded_logprobs_are_the_raw_ones_before_the_mask(calc, temperature):
    model, tok = calc
    grammar = json_schema_grammar(SCHEMA)
    gen = ModelGenerate(model, tok, max_new_tokens=40, temperature=temperature, seed=3)
    masked_gap = 0.0
    for r, group in zip(rollouts(), gen.generate(rollouts(), n=4, sampling=SamplingConfig(
            max_new_tokens=40, temperature=temperature, grammar=grammar)), strict=True):
        prompt = encode_prompt(r, tok)
        for m in group:
            assert m.temperature == temperature
            want = reference_logprobs(model, prompt, m.token_ids, temperature)  # float64, raw logits
            # float32 batched decode vs a float64 forward (T = 0.7 scales the logits' rounding by 1 / T);
            # log-probs after the mask would differ by > 1 (masked_gap below)
            assert torch.allclose(torch.tensor(m.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
            masked_gap = max(masked_gap, float(-want.min()))
    assert masked_gap > 1.0  # the grammar forced tokens the model found unlikely: the mask mattered


def test_every_sampled_json_parses_and_validates(calc):
    jsonschema = pytest.importorskip("jsonschema")
    model, tok = calc
    gen = ModelGenerate(model, tok, max_new_tokens=60, temperature=1.0, seed=11)
    cfg = SamplingConfig(max_new_tokens=60, temperature=1.0, grammar=json_schema_grammar(SCHEMA))
    texts = [m.content for g in gen.generate(rollouts(), n=8, sampling=cfg) for m in g]
    for text in texts:  # strict=False: xgrammar 0.2.8 lets a control character into a maxLength string
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
    assert len(set(texts)) > 4  # sampled, not one forced string


def test_a_grammar_that_does_not_compile_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"grammar 'root ::= undefined_rule' does not compile.*undefined_rule"):
        SamplingConfig(grammar="root ::= undefined_rule")
    with pytest.raises(ValueError, match="grammar must be None or EBNF"):
        SamplingConfig(grammar="  ")
    with pytest.raises(ValueError, match="JSON schema.*bogus"):
        json_schema_grammar({"type": "bogus"})


def test_the_compiled_grammar_is_cached_per_tokenizer_and_vocab(calc):
    _, tok = calc
    a = compiled_grammar(tok, 2304, ANSWER)
    assert compiled_grammar(tok, 2304, ANSWER) is not None
    assert a.tokenizer_info.vocab_size == 2304
    assert compiled_grammar(tok, 2368, ANSWER).tokenizer_info.vocab_size == 2368  # a padded lm_head


def test_eos_ids_past_the_logits_are_left_out_of_the_matchers(calc):
    model, tok = calc
    cfg = SamplingConfig(max_new_tokens=16, do_sample=False, grammar=ANSWER, eos_token_ids=(99999, tok.eos_token_id))
    [[m]] = ModelGenerate(model, tok).generate(rollouts(1), sampling=cfg)
    assert m.content.startswith("The answer is ") and m.token_ids[-1] == tok.eos_token_id
    with pytest.raises(ValueError, match="needs an EOS id below the vocabulary size 2304"):
        ModelGenerate(model, tok).generate(rollouts(1), sampling=SamplingConfig(grammar=ANSWER,
                                                                                  eos_token_ids=(99999,)))
