"""The fast HF decode (`decode="fast"`: static KV cache, one decode step per CUDA graph replay on GPUs)
against the default path (`model.generate`): same ids under the same seed, same log-probs within
float32 rounding, same finish reasons; on CUDA (when present) the graph path is what runs.
"""

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation import fast_decode
from SimpleTorchLLMRL.model.generation.fast_decode import DECODERS, StaticDecoder, supports_fast_decode
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from tests.support.generation_helpers import make_generator, peaked, reference_logprobs

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STYLE = {"qwen2": "chatml", "llama": "llama3", "gpt2": "plain"}
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0),
    "t07_topk_topp": dict(temperature=0.7, top_k=20, top_p=0.9),
    "stops": dict(temperature=1.0, stop=["a", "e "], tool_call_stop=["</tool_call>"]),
}
LOGPROB_TOL = 1e-5  # float32: the static cache attends over masked slots, the dynamic one over the tokens so far


def questions(n=3):
    texts = ["What is 12 + 35?", "hi", "def f(x):\n    return x ** 2 + 1. What is f(3)?", "The quick fox"]
    return [Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM), Message(t)])
            for t in (texts * 2)[:n]]


def both(model, tok, rollouts, n=2, device="cpu", calls=1, compile=False, **kw):
    """(default groups, fast groups): `calls` consecutive generate calls each, one seed. `compile`: the
    fast decode's forward under torch.compile (its default on CUDA; off here, one test turns it on)."""
    out = {}
    for decode in ("default", "fast"):
        gen = make_generator(model.to(device), tok, seed=5, decode=decode, **kw)
        gen.backend.compile_decode = compile
        out[decode] = [gen.generate(rollouts, n=n) for _ in range(calls)]
    return out["default"], out["fast"]


def assert_same(default, fast, tol=LOGPROB_TOL):
    for call_a, call_b in zip(default, fast, strict=True):
        for group_a, group_b in zip(call_a, call_b, strict=True):
            for a, b in zip(group_a, group_b, strict=True):
                assert a.token_ids == b.token_ids
                assert (a.finish_reason, a.content) == (b.finish_reason, b.content)
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= tol


@pytest.fixture(scope="module", params=list(STYLE))
def arch(request):
    tok = tiny_tokenizer(STYLE[request.param])
    return peaked(tiny_model(request.param, tok), std=0.08), tok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_fast_decode_samples_the_default_paths_ids(arch, sampling, device):
    model, tok = arch
    default, fast = both(model, tok, questions(3), n=2, device=device, max_new_tokens=24, **SAMPLINGS[sampling])
    assert_same(default, fast)
    if device == "cuda":  # the graph path ran, not the eager fallback
        assert DECODERS[model][1].graph is not None
    model.to("cpu")


# logit_bias / frequency / presence penalties: the picker's in-place offset, per completion (ids 9, 40: any two)
SHIFTED = {
    "bias_penalties": SamplingConfig(max_new_tokens=24, temperature=0.9, logit_bias={9: 2.0, 40: -3.0},
                                     frequency_penalty=0.8, presence_penalty=0.5),
    "greedy_penalties": SamplingConfig(max_new_tokens=24, temperature=0.0, frequency_penalty=1.5,
                                       presence_penalty=0.5),
    "truncated_bias": SamplingConfig(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9, logit_bias={9: 1.5},
                                     presence_penalty=-0.5),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shift", list(SHIFTED))
def test_bias_and_penalties_sample_the_same_ids_on_both_paths(arch, shift, device):
    """Two calls each: the second reuses the fast decoder and its picker, whose counts restart at zero."""
    model, tok = arch
    default, fast = both(model, tok, questions(3), n=2, device=device, calls=2, sampling=SHIFTED[shift])
    assert_same(default, fast)
    assert all(m.sampling == SHIFTED[shift].distribution_changes() for call in fast for g in call for m in g)
    model.to("cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_forward_samples_the_same_ids(device):
    """torch.compile'd decode forward (the CUDA default); sampling stays outside the compiled code."""
    from SimpleTorchLLMRL.model.generation.fast_decode import _decode_forward

    tok = tiny_tokenizer("chatml")
    model = peaked(tiny_model("qwen2", tok), std=0.08)
    for sampling in ("t1", "greedy"):  # the second reuses the compiled forward with another picker
        default, fast = both(model, tok, questions(3), n=2, device=device, compile=True, max_new_tokens=16,
                             **SAMPLINGS[sampling])
        assert_same(default, fast)
        assert DECODERS[model][1].forward is not _decode_forward  # compiled, not fallen back


@pytest.mark.parametrize("device", DEVICES)
def test_fast_logprobs_equal_a_float64_forward(qwen, device):
    model, tok = qwen
    rollouts = questions(3)
    gen = ModelGenerate(model.to(device), tok, max_new_tokens=20, temperature=0.8, seed=1,
                        backend=BackendConfig(decode="fast"))
    groups = gen.generate(rollouts, n=2)
    model64 = model.to("cpu").double()
    try:
        for r, group in zip(rollouts, groups, strict=True):
            prompt = encode_prompt(r, tok)
            for msg in group:
                ref = reference_logprobs(model64, prompt, msg.token_ids, 0.8)
                torch.testing.assert_close(torch.tensor(msg.logprobs, dtype=torch.float64), ref, atol=2e-5, rtol=0)
    finally:
        model.float()


@pytest.mark.parametrize("device", DEVICES)
def test_calls_reuse_the_decoder_and_follow_in_place_weight_updates(qwen, device):
    model, tok = copy_of(qwen)
    model.to(device)
    kw = dict(max_new_tokens=16, temperature=1.0)
    default, fast = both(model, tok, questions(3), device=device, calls=2, **kw)
    assert_same(default, fast)
    decoder = DECODERS[model][1]
    with torch.no_grad():  # an optimizer-like step: same tensors, new values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    default2, fast2 = both(model, tok, questions(3), device=device, **kw)
    assert_same(default2, fast2)
    assert DECODERS[model][1] is decoder  # same shape, same weight tensors: the cache (and graph) are reused
    assert [m.token_ids for g in fast2[0] for m in g] != [m.token_ids for g in fast[0] for m in g]
    make_generator(model, tok, decode="fast", **kw).sleep()
    assert model not in DECODERS


def copy_of(pair):
    import copy

    return copy.deepcopy(pair[0]), pair[1]


def test_the_decode_loop_stops_once_every_row_has_ended(qwen, monkeypatch):
    model, tok = qwen
    steps = []
    step = StaticDecoder._step
    monkeypatch.setattr(StaticDecoder, "_step", lambda self: (steps.append(1), step(self)))
    half = list(range(len(tok) // 2))  # EOS ids: every row ends within a few tokens
    default, fast = both(model, tok, questions(3), max_new_tokens=64, temperature=1.0, eos_token_ids=half)
    assert_same(default, fast)
    assert all(m.finish_reason == "stop" for g in fast[0] for m in g)
    assert len(steps) == fast_decode.CHECK_EVERY  # checked after 16 steps, not run to 64


def test_batch_size_splits_and_mixed_prompt_lengths(qwen):
    model, tok = qwen
    rollouts = questions(4)
    default, fast = both(model, tok, rollouts, n=3, batch_size=5, max_new_tokens=12, temperature=1.0)
    assert_same(default, fast)


def test_lora_and_per_agent_adapters(qwen):
    from SimpleTorchLLMRL.model.adapters import add_agent_adapters

    base, tok = copy_of(qwen)
    model = add_agent_adapters(base, ["A", "B"], r=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: give each agent its own policy
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    for agent in ("A", "B"):
        got = {}
        for decode in ("default", "fast"):
            gen = ModelGenerate(model, tok, seed=2, max_new_tokens=12, temperature=1.0,
                                backend=BackendConfig(decode=decode))
            got[decode] = [gen.generate(questions(2), n=2, adapter=agent)]
        assert_same(got["default"], got["fast"])
        assert DECODERS[model][0][3] == agent  # the adapter is part of the decoder's key


def test_nan_scores_raise_the_same_error(qwen):
    model, tok = copy_of(qwen)
    with torch.no_grad():
        model.get_output_embeddings().weight.fill_(float("nan"))
    for decode in ("default", "fast"):
        gen = ModelGenerate(model, tok, seed=0, max_new_tokens=4, temperature=1.0,
                            backend=BackendConfig(decode=decode))
        with pytest.raises(ValueError, match="cannot sample: the scores of 2 of 2 rows"):
            gen.generate(questions(1), n=2)


def test_models_without_a_full_attention_static_cache_are_refused_or_left_default():
    from transformers import AutoModelForCausalLM, MistralConfig

    tok = tiny_tokenizer("chatml")
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    sliding = AutoModelForCausalLM.from_config(cfg)
    assert not supports_fast_decode(sliding)
    with pytest.raises(ValueError, match="decode='fast' needs a decoder-only model whose transformers StaticCache"):
        ModelGenerate(sliding, tok, backend=BackendConfig(decode="fast"))
    auto = ModelGenerate(sliding, tok, backend=BackendConfig(decode="auto")).backend
    assert not auto.uses_fast_decode(torch.device("cuda"))
    qwen_auto = ModelGenerate(tiny_model("qwen2", tok), tok).backend
    assert qwen_auto.uses_fast_decode(torch.device("cuda")) and not qwen_auto.uses_fast_decode(torch.device("cpu"))
    with pytest.raises(ValueError, match="decode must be one of"):
        ModelGenerate(tiny_model("qwen2", tok), tok, backend=BackendConfig(decode="static"))


def test_multi_turn_calculator_episodes_on_the_real_tokenizer():
    """The embedded model with its real tokenizer and template: the same rollouts, masks and tool calls."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from SimpleTorchLLMRL.env.rollouts import collect_rollouts
    from SimpleTorchLLMRL.env.tool_use import ToolUseEnv
    from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT
    from SimpleTorchLLMRL.testing.tiny import TINY_CALC
    from SimpleTorchLLMRL.tools import calculator

    model = AutoModelForCausalLM.from_pretrained(TINY_CALC, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TINY_CALC)
    got = {}
    for decode in ("default", "fast"):
        env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=2)
        gen = ModelGenerate(model, tok, max_new_tokens=40, temperature=1.0, tool_call_stop=env.stop_strings,
                            seed=1, backend=BackendConfig(decode=decode))
        got[decode] = collect_rollouts(gen, env, ["What is 645 * 49?", "What is 312 + 85?"], ["31605", "397"],
                                       group_size=2)
    turns = 0
    for a, b in zip(got["default"], got["fast"], strict=True):
        assert [(m.type, m.content, m.token_ids, m.trainable) for m in a.messages] == \
               [(m.type, m.content, m.token_ids, m.trainable) for m in b.messages]
        turns += sum(m.type is MessageType.MODEL for m in a.messages)
        for ma, mb in zip(a.messages, b.messages, strict=True):
            if ma.logprobs:
                assert max(abs(x - y) for x, y in zip(ma.logprobs, mb.logprobs, strict=True)) <= LOGPROB_TOL
    assert turns > len(got["fast"])  # some episodes called the tool and took a second turn


def test_only_the_first_shapes_of_a_model_are_compiled(qwen, monkeypatch):
    """Each turn of multi-turn episodes can bring a new row count; past MAX_COMPILED_SHAPES a model's new shapes
    run without torch.compile (one warning), and still sample the default path's ids."""
    import functools

    from SimpleTorchLLMRL.model.generation.fast_decode import _decode_forward

    model, tok = copy_of(qwen)
    stand_in = functools.partial(_decode_forward)  # counts as "compiled" without paying for a compile
    monkeypatch.setattr(fast_decode, "compiled_forward", lambda: stand_in)
    monkeypatch.setattr(fast_decode, "MAX_COMPILED_SHAPES", 1)
    gen = ModelGenerate(model, tok, max_new_tokens=8, temperature=1.0, seed=0,
                        backend=BackendConfig(decode="fast"))
    gen.backend.compile_decode = True
    gen.generate(questions(2))
    assert DECODERS[model][1].forward is stand_in
    gen.generate(questions(2))  # the same shape keeps its compiled forward
    assert DECODERS[model][1].forward is stand_in
    with pytest.warns(RuntimeWarning, match="1 batch shapes of this model are compiled already"):
        gen.generate(questions(3))
    assert DECODERS[model][1].forward is _decode_forward
    default, fast = both(model, tok, questions(3), n=1, compile=True, max_new_tokens=8, temperature=1.0)
    assert_same(default, fast)
