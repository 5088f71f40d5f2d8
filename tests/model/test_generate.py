"""ModelGenerate (HF backend): sampled ids, log-probs, finish reasons, the prefix invariant, batching, seeds."""

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate, extend_groups
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig, cut_sample, default_eos_ids
from SimpleTorchLLMRL.testing.tiny import tiny_model, tiny_tokenizer
from tests.support.generation_helpers import peaked, reference_logprobs

ARCH = {"chatml": "qwen2", "llama3": "llama", "plain": "gpt2"}


@pytest.fixture(scope="module")
def model(tok):
    return peaked(tiny_model("qwen2", tok))


def questions(n=4):
    texts = ["What is 12 + 35?", "hi", "def f(x):\n    return x", "How many apples? Answer: 7", "The quick fox"]
    return [Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM), Message(t)])
            for t in (texts * 2)[:n]]


# ----------------------------------------------------------------------------- sampled ids, log-probs, reasons


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_a_fresh_forward(model, tok, temperature):
    gen = ModelGenerate(model, tok, max_new_tokens=12, temperature=temperature, seed=3)
    rollouts = questions(3)
    for r, (msg,) in zip(rollouts, gen.generate(rollouts), strict=True):
        assert msg.type is MessageType.MODEL and msg.temperature == temperature
        assert len(msg.token_ids) == len(msg.logprobs) >= 1
        ref = reference_logprobs(model, encode_prompt(r, tok), msg.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(msg.logprobs, dtype=torch.float64), ref, atol=1e-3, rtol=0)


def test_logprobs_are_of_the_top_k_top_p_distribution(model, tok):
    gen = ModelGenerate(model, tok, seed=1,
                        sampling=SamplingConfig(max_new_tokens=10, temperature=0.8, top_k=5, top_p=0.9))
    r = questions(1)[0]
    msg = gen.rollout_generate_response(r)
    full = reference_logprobs(model, encode_prompt(r, tok), msg.token_ids, 0.8)  # the untruncated distribution
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encode_prompt(r, tok) + msg.token_ids])).logits[0].double()
    truncated = []
    for k, t in enumerate(msg.token_ids):  # every sampled token is inside the top-5 of its step ...
        step = logits[len(encode_prompt(r, tok)) - 1 + k] / 0.8
        assert t in torch.topk(step, 5).indices.tolist()
        step = step.masked_fill(step < torch.topk(step, 5).values[-1], float("-inf"))
        p = torch.softmax(step, -1)
        order = torch.argsort(p, descending=True)
        step[order[torch.cumsum(p[order], 0) - p[order] >= 0.9]] = float("-inf")  # ... and top-p 0.9 of those
        truncated.append(torch.log_softmax(step, -1)[t])
    got = torch.tensor(msg.logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, torch.stack(truncated), atol=1e-4, rtol=0)  # recorded: the truncated one
    assert (got - full).abs().max() > 1e-3 and msg.sampling == {"top_k": 5, "top_p": 0.9}


def test_greedy_records_logprobs_at_configured_temperature(model, tok):
    r = questions(1)[0]
    msg = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=6, temperature=0.5,
                                                do_sample=False)).rollout_generate_response(r)
    assert msg.temperature == 0.5
    ref = reference_logprobs(model, encode_prompt(r, tok), msg.token_ids, 0.5)
    torch.testing.assert_close(torch.tensor(msg.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
    zero = ModelGenerate(model, tok, max_new_tokens=6, temperature=0).rollout_generate_response(r)
    assert zero.token_ids == msg.token_ids and zero.temperature == 1.0  # T=0: greedy, log-probs at T=1


def greedy_ids(model, tok, r, n=12):
    return ModelGenerate(model, tok,
                         sampling=SamplingConfig(max_new_tokens=n,
                                                 do_sample=False)).rollout_generate_response(r).token_ids


def test_eos_cuts_and_is_kept(model, tok):
    r = questions(1)[0]
    full = greedy_ids(model, tok, r)
    eos = full[4]
    k = full.index(eos)
    msg = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=12, do_sample=False,
                                                eos_token_ids=[eos])).rollout_generate_response(r)
    assert msg.token_ids == full[: k + 1] and msg.finish_reason == "stop"
    long = ModelGenerate(model, tok,
                         sampling=SamplingConfig(max_new_tokens=12,
                                                 do_sample=False)).rollout_generate_response(r)
    assert long.finish_reason == "length" and len(long.token_ids) == 12


def test_stop_string_cuts_text_and_ids_and_stops_the_batch_early(model, tok):
    r = questions(1)[0]
    full = greedy_ids(model, tok, r, 16)
    stop_at = 5  # a stop string completed by token 5: the last 2 chars of its decoded text
    text5 = tok.decode(full[: stop_at + 1], skip_special_tokens=True)
    text4 = tok.decode(full[:stop_at], skip_special_tokens=True)
    stop = text5[len(text4) - 1:]  # straddles tokens 4 and 5
    assert stop and stop not in text4
    first = next(k for k in range(16) if stop in tok.decode(full[: k + 1], skip_special_tokens=True))
    calls = []
    orig = model.generate

    def spy(*a, **kw):
        out = orig(*a, **kw)
        calls.append(out.shape[1] - kw["input_ids"].shape[1])
        return out

    model.generate = spy
    try:
        gen = ModelGenerate(model, tok,
                            sampling=SamplingConfig(max_new_tokens=16, do_sample=False, stop=[stop]))
        msg = gen.rollout_generate_response(r)
    finally:
        del model.generate
    assert msg.token_ids == full[: first + 1] and msg.finish_reason == "stop"
    assert msg.content.endswith(stop) and msg.content.count(stop) == 1
    assert calls == [first + 1]  # the StoppingCriteria ended generation there, not at max_new_tokens
    tool = ModelGenerate(model, tok,
                         sampling=SamplingConfig(max_new_tokens=16, do_sample=False, tool_call_stop=[stop]))
    assert tool.rollout_generate_response(r).finish_reason == "tool_call"


def test_cut_sample_never_keeps_padding_and_prefers_earliest_end(tok):
    cfg = SamplingConfig(max_new_tokens=8, stop=("xyz",), eos_token_ids=(2,))
    ids = tok("ab", add_special_tokens=False)["input_ids"] + [2, 0, 0, 0]
    s = cut_sample(tok, ids, [-1.0] * len(ids), cfg)
    assert s.token_ids == ids[: ids.index(2) + 1] and s.finish_reason == "stop" and s.text == "ab"
    assert len(s.logprobs) == len(s.token_ids)


def test_batch_with_pads_keeps_no_pad_after_the_end(model, tok):
    rollouts = questions(4)
    fulls = [greedy_ids(model, tok, r) for r in rollouts]
    eos = fulls[0][2]
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=12, do_sample=False, eos_token_ids=[eos]))
    for full, (msg,) in zip(fulls, gen.generate(rollouts), strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert msg.token_ids == full[:end]
        assert msg.finish_reason == ("stop" if eos in full else "length")


def test_default_eos_ids_merge_tokenizer_and_generation_config(model, tok):
    model.generation_config.eos_token_id = [tok.eos_token_id, 0]
    try:
        assert default_eos_ids(tok, model) == (tok.eos_token_id, 0)
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id


# ----------------------------------------------------------------------------- prefix invariant


@pytest.mark.parametrize("style", ["chatml", "llama3", "plain"])
def test_prompt_plus_sampled_ids_prefix_encode_rollout_multi_turn(style):
    t = tiny_tokenizer(style)
    m = peaked(tiny_model(ARCH[style], t))
    gen = ModelGenerate(m, t, max_new_tokens=8, temperature=1.0, seed=0)
    r = Rollout([Message("Be brief.", MessageType.SYSTEM), Message("What is 7 * 8?")])
    spans = []
    for turn in range(3):
        prompt = encode_prompt(r, t)
        msg = gen.rollout_generate_response(r)
        r.add_messages(msg)
        spans.append((len(prompt), prompt + msg.token_ids, msg))
        enc = encode_rollout(r, t)
        assert enc.input_ids[: len(prompt) + len(msg.token_ids)] == prompt + msg.token_ids
        r.add_messages(Message(f"tool output {turn}", MessageType.TOOL if style == "chatml" else MessageType.MESSAGE))
    enc = encode_rollout(r, t)
    for start, ids, msg in spans:  # every turn still sits verbatim in the final encoding, trained, with log-probs
        assert enc.input_ids[: len(ids)] == ids
        assert enc.loss_mask[start: len(ids)] == [1] * len(msg.token_ids)
        torch.testing.assert_close(torch.tensor(enc.sampler_logprobs[start: len(ids)]), torch.tensor(msg.logprobs))


# ----------------------------------------------------------------------------- batching, seeds, modes


def test_batch_equals_one_at_a_time_under_greedy(model, tok):
    rollouts = questions(4)
    gen = ModelGenerate(model, tok,
                        sampling=SamplingConfig(max_new_tokens=10, do_sample=False, stop=["ction"]))
    batch = gen.generate(rollouts)
    for r, (b,) in zip(rollouts, batch, strict=True):
        one = gen.rollout_generate_response(r)
        assert b.token_ids == one.token_ids and b.finish_reason == one.finish_reason and b.content == one.content
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(one.logprobs), atol=1e-4, rtol=0)
    small = ModelGenerate(model, tok,
                          sampling=SamplingConfig(max_new_tokens=10, do_sample=False, stop=["ction"]),
                          backend=BackendConfig(batch_size=2))
    assert [g[0].token_ids for g in small.generate(rollouts)] == [g[0].token_ids for g in batch]


def test_seeded_generation_is_reproducible_and_leaves_global_rng_alone(model, tok):
    rollouts = questions(2)

    def run(seed):
        gen = ModelGenerate(model, tok, max_new_tokens=6, temperature=1.0, seed=seed)
        return [[m.token_ids for m in g] for g in gen.generate(rollouts, n=2)], gen

    state = torch.get_rng_state()
    a, gen_a = run(7)
    assert torch.equal(state, torch.get_rng_state())
    b, gen_b = run(7)
    c, _ = run(8)
    assert a == b and a != c
    assert a[0][0] != a[0][1]  # the n samples of one prompt differ
    again_a = [[m.token_ids for m in g] for g in gen_a.generate(rollouts, n=2)]
    again_b = [[m.token_ids for m in g] for g in gen_b.generate(rollouts, n=2)]
    assert again_a == again_b and again_a != a  # later calls differ from the first, reproducibly


def test_restores_training_mode_and_builds_no_graph(model, tok):
    model.train()
    try:
        seen = []
        hook = model.register_forward_hook(lambda mod, i, o: seen.append((mod.training, torch.is_grad_enabled())))
        ModelGenerate(model, tok, max_new_tokens=3, seed=0).rollout_generate_response(questions(1)[0])
        hook.remove()
        assert seen and all(not training and not grad for training, grad in seen)
        assert model.training
    finally:
        model.eval()


def test_group_forms(model, tok):
    rollouts = questions(2)
    gen = ModelGenerate(model, tok, max_new_tokens=5, temperature=1.0, seed=0)
    groups = gen.generate(rollouts, n=3)
    assert [len(g) for g in groups] == [3, 3]
    copies = extend_groups(rollouts, gen.generate(rollouts, n=3))
    assert len(copies) == 6 and [c.metadata["group_id"] for c in copies] == [0, 0, 0, 1, 1, 1]
    assert all(len(c) == 3 and c[-1].type is MessageType.MODEL for c in copies)
    assert all(len(r) == 2 for r in rollouts)  # originals untouched
    gen.batch_rollout_generate_response(rollouts)
    assert all(len(r) == 3 and r[-1].type is MessageType.MODEL for r in rollouts)


# ----------------------------------------------------------------------------- bad input


def test_empty_list_returns_without_touching_the_model(model, tok):
    gen = ModelGenerate(model, tok)
    model.generate = lambda *a, **k: pytest.fail("generate called for an empty batch")
    try:
        assert gen.generate([]) == [] and gen.batch_rollout_generate_response([]) is None
    finally:
        del model.generate


@pytest.mark.parametrize("kwargs, word", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(backend="tpu"), "backend"), (dict(seed=-1), "seed"),
    (dict(backend=lambda: BackendConfig(decode="slow")), "decode"),
    (dict(backend=lambda: BackendConfig(batch_size=0)), "batch_size"),
    (dict(sampling=lambda: SamplingConfig(top_p=0.0)), "top_p"), (dict(sampling=lambda: SamplingConfig(top_k=-1)), "top_k"),
    (dict(sampling=lambda: SamplingConfig(stop=[""])), "stop"),
])
def test_bad_config_raises_value_error(model, tok, kwargs, word):
    with pytest.raises(ValueError, match=word):
        ModelGenerate(model, tok, **{k: v() if callable(v) else v for k, v in kwargs.items()})


def test_the_constructor_takes_at_most_eight_parameters():
    import inspect

    params = [p for p in inspect.signature(ModelGenerate.__init__).parameters if p != "self"]
    assert params == ["model", "tokenizer", "max_new_tokens", "temperature", "tool_call_stop", "sampling", "backend",
                      "seed"]


def test_one_entry_point_and_the_seed_api(model, tok):
    """`generate` is the one way to sample; the seed's two calls run through it, and the old ones are gone."""
    public = {n for n in dir(ModelGenerate) if not n.startswith("_") and callable(getattr(ModelGenerate, n))}
    assert public == {"generate", "rollout_generate_response", "batch_rollout_generate_response", "prompt_ids",
                      "fits", "push_weights", "sleep", "wake_up"}
    gen = ModelGenerate(model=model, tokenizer=tok, max_new_tokens=6, temperature=0.7)  # the seed's spelling
    r = questions(1)[0]
    msg = gen.rollout_generate_response(r)
    assert msg.type is MessageType.MODEL and msg.token_ids and len(r) == 2
    rs = questions(2)
    gen.batch_rollout_generate_response(rs)
    assert [len(x) for x in rs] == [3, 3] and all(x[-1].type is MessageType.MODEL for x in rs)


def test_prompt_over_context_names_the_rollout(tok):
    m = tiny_model("qwen2", tok, max_position_embeddings=64)
    gen = ModelGenerate(m, tok, max_new_tokens=16)
    rollouts = [Rollout([Message("hi")]), Rollout([Message("The quick brown fox jumps over the lazy dog. " * 4)])]
    with pytest.raises(ValueError, match="prompt 1"):
        gen.generate(rollouts)
    ids = gen.prompt_ids(rollouts)
    assert gen.fits(ids[0]) and not gen.fits(ids[1])
    with pytest.raises(ValueError, match="empty prompt"):
        ModelGenerate(m, tiny_tokenizer("plain"), max_new_tokens=4).generate([Rollout()])


def test_unseeded_calls_draw_fresh_samples_from_the_global_rng(chatml_tokenizer):
    """Without a seed, two calls on the same prompt must not replay the same RNG stream."""
    from SimpleTorchLLMRL.chat.message import Message, Rollout
    from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
    from SimpleTorchLLMRL.testing.tiny import tiny_model

    model = tiny_model("qwen2", chatml_tokenizer)
    gen = ModelGenerate(model, chatml_tokenizer, max_new_tokens=12, temperature=1.0)
    rollouts = [Rollout([Message("hello")]) for _ in range(4)]
    torch.manual_seed(0)
    first = [m[0].token_ids for m in gen.generate(rollouts)]
    second = [m[0].token_ids for m in gen.generate(rollouts)]
    assert first != second
    torch.manual_seed(0)
    assert [m[0].token_ids for m in gen.generate(rollouts)] == first  # the global seed still governs them


def test_sampling_options_as_one_object(qwen2_model, chatml_tokenizer):
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.9, stop=("x",))
    a = ModelGenerate(qwen2_model, chatml_tokenizer, sampling=cfg, seed=3)
    b = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=5, temperature=0.9, seed=3,
                      sampling=None)
    r = Rollout([Message("hello there")])
    assert a.config.stop == ("x",) and cfg.eos_token_ids == ()  # the caller's object is not filled in
    assert [m.token_ids for m in a.generate([r], n=3)[0]] != [] and b.config.stop == ()
    with pytest.raises(ValueError, match=r"sampling= and also \['temperature'\]"):
        ModelGenerate(qwen2_model, chatml_tokenizer, temperature=0.5, sampling=cfg)


def test_prompt_ids_are_passed_explicitly_and_encoded_once(qwen2_model, chatml_tokenizer, monkeypatch):
    """`generate(rollouts, prompt_ids=...)` samples from the ids given (nothing is looked up by identity);
    without them each prompt is encoded once per call."""
    import SimpleTorchLLMRL.model.generation.generator as G

    calls = []
    real = G.encode_prompt
    monkeypatch.setattr(G, "encode_prompt", lambda r, tok: calls.append(id(r)) or real(r, tok))
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=3, seed=0)
    rs = [Rollout([Message(f"question {i}")]) for i in range(3)]
    ids = gen.prompt_ids(rs)
    calls.clear()
    with_ids = gen.generate(rs, prompt_ids=ids, seed=4)
    assert calls == []  # the ids given, not encoded again
    assert [m.token_ids for g in with_ids for m in g] == [m.token_ids for g in gen.generate(rs, seed=4) for m in g]
    assert sorted(calls) == sorted(id(r) for r in rs)
    as_ids = gen.generate(ids, seed=4)  # token-id prompts: sampled from as they are
    assert [m.token_ids for g in as_ids for m in g] == [m.token_ids for g in with_ids for m in g]
    with pytest.raises(ValueError, match="prompt_ids has 2 prompts for 3"):
        gen.generate(rs, prompt_ids=ids[:2])
    with pytest.raises(TypeError, match="prompt 0 is a str"):
        gen.generate(["hello"])


def test_a_seeded_prompt_samples_the_same_alone_or_batched(qwen2_model, chatml_tokenizer):
    """Per-row streams: a prompt's samples under its seed do not depend on what else is in the call (HF loop)."""
    gen = ModelGenerate(qwen2_model, chatml_tokenizer, max_new_tokens=12, temperature=1.0)
    r = Rollout([Message("hello there")])
    others = [Rollout([Message("a much longer question that pads the batch " * 3)]), Rollout([Message("hi")])]
    alone = [m.token_ids for m in gen.generate([r], n=2, seed=11)[0]]
    batched = gen.generate([others[0], r, others[1], r], n=2, seed=[None, 11, 5, 11])
    assert [m.token_ids for m in batched[1]] == alone and [m.token_ids for m in batched[3]] == alone
    assert alone[0] != alone[1]  # sample j has its own stream
    assert [m.token_ids for m in batched[2]] != alone
