"""logit_bias, frequency_penalty and presence_penalty: the picker's distribution against a float64
reference, both HF decode loops, recorded log-probs of the raw logits, `Message.sampling` on disk, vLLM's
`SamplingParams` and log-probs modes, and the gateway through the real `openai` SDK.

Legend: B rows, V vocab.
"""

import json

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.rollout_io import load_rollouts, save_rollouts
from SimpleTorchLLMRL.chat.tokenize import encode_prompt
from SimpleTorchLLMRL.model.generation import picker as picker_module
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
from SimpleTorchLLMRL.model.generation.picker import TokenPicker
from SimpleTorchLLMRL.model.generation.sampling import SamplingConfig
from tests.model.test_sampling import chi_square_ok
from tests.support.generation_helpers import reference_logprobs

DECODES = ("default", "fast")

# ----------------------------------------------------------------------------- SamplingConfig


def test_the_config_stores_bias_as_sorted_pairs_and_validates():
    cfg = SamplingConfig(logit_bias={"30": -100, 4: 2.5, 7: 0}, frequency_penalty=1, presence_penalty=-0.5)
    assert cfg.logit_bias == ((4, 2.5), (30, -100.0))  # sorted, floats, the zero bias dropped
    assert cfg.frequency_penalty == 1.0 and isinstance(cfg.frequency_penalty, float)
    assert hash(cfg.logit_bias) == hash(SamplingConfig(logit_bias=[(30, -100.0), (4, 2.5)]).logit_bias)
    assert SamplingConfig(logit_bias=cfg.logit_bias).logit_bias == cfg.logit_bias
    for kw, word in [(dict(logit_bias={-1: 1.0}), "ids"), (dict(logit_bias={"x": 1.0}), "ids"),
                     (dict(logit_bias={True: 1.0}), "ids"), (dict(logit_bias={3: float("nan")}), "finite"),
                     (dict(logit_bias={3: float("inf")}), "finite"), (dict(logit_bias={3: "1"}), "finite"),
                     (dict(logit_bias=[(3, 1.0), (3, 2.0)]), "twice"), (dict(logit_bias=5), "dict"),
                     (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence"),
                     (dict(presence_penalty=True), "presence_penalty"),
                     (dict(frequency_penalty=float("nan")), "frequency_penalty")]:
        with pytest.raises(ValueError, match=word):
            SamplingConfig(**kw)
    with pytest.raises(ValueError, match="token id 30.*vocabulary of 30"):
        cfg.check_vocabulary(30)
    cfg.check_vocabulary(31)


def test_distribution_changes_lists_what_is_set():
    assert SamplingConfig(temperature=0.7).distribution_changes() is None
    assert SamplingConfig(top_p=1.0, top_k=0).distribution_changes() is None
    changes = SamplingConfig(top_k=5, top_p=0.9, logit_bias={3: -1}, frequency_penalty=0.5,
                             presence_penalty=0.25).distribution_changes()
    assert changes == {"top_k": 5, "top_p": 0.9, "logit_bias": {"3": -1.0}, "frequency_penalty": 0.5,
                       "presence_penalty": 0.25}
    assert json.loads(json.dumps(changes)) == changes  # JSON as it is
    greedy = SamplingConfig(do_sample=False, top_k=5, presence_penalty=1.0)  # an argmax ignores top-k
    assert greedy.distribution_changes() == {"presence_penalty": 1.0}


# ----------------------------------------------------------------------------- the picker against float64

BIAS = {3: 2.5, 6: -1.5}
FORCED = [[2, 1, 0], [2, 5, 0], [4, 5, 0]]  # forced picks, step by step, of rows 0, 1, 2


def forced_history(picker: TokenPicker, V: int) -> torch.Tensor:
    """Run the picker through FORCED (each forced token 60 logits above the rest); (B, V) float64 counts."""
    B = len(FORCED[0])
    counts = torch.zeros(B, V, dtype=torch.float64)
    for step in FORCED:
        scores = torch.zeros(B, V)
        scores[torch.arange(B), torch.tensor(step)] = 60.0
        tok, _, _ = picker.pick(scores)
        assert tok.tolist() == step
        counts[torch.arange(B), torch.tensor(step)] += 1
    return counts


def reference_probs(scores, counts, T, fp, pp, bias, top_k=None):
    """float64: softmax((scores + bias - fp * count - pp * (count > 0)) / T), top-k after the shift."""
    z = scores.double().clone()
    for t, b in bias.items():
        z[:, t] += b
    z = (z - fp * counts - pp * (counts > 0).double()) / T
    if top_k:
        z = z.masked_fill(z < z.topk(top_k, -1).values[:, -1:], float("-inf"))
    return torch.softmax(z, -1)


@pytest.mark.parametrize("T,top_k,fp,pp", [(1.0, None, 0.8, 0.5), (0.7, None, -0.6, 1.3), (0.7, 4, 1.1, 0.0),
                                           (1.3, None, 0.0, 2.0)])
def test_the_picker_samples_the_penalized_biased_distribution(monkeypatch, T, top_k, fp, pp):
    V = 7
    picker = TokenPicker(SamplingConfig(temperature=T, top_k=top_k, logit_bias=BIAS, frequency_penalty=fp,
                                        presence_penalty=pp))
    counts = forced_history(picker, V)
    assert counts[2, 0] == 3 and counts[0, 2] == 2  # repeated ids: frequency and presence differ
    seen = []
    real = picker_module.inverse_cdf_sample
    monkeypatch.setattr(picker_module, "inverse_cdf_sample", lambda p, check=True, u=None: seen.append(p.clone()) or real(p, check, u))
    scores = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 2
    tok, logprob, _ = picker.pick(scores)
    [p] = seen
    want = reference_probs(scores, counts, T, fp, pp, BIAS, top_k)
    torch.testing.assert_close(p.double() / p.double().sum(-1, keepdim=True), want, atol=1e-6, rtol=0)
    raw = torch.log_softmax(scores.double() / T, -1)  # the recorded log-prob: raw logits at T
    torch.testing.assert_close(logprob.double(), raw.gather(1, tok[:, None]).squeeze(1), atol=1e-6, rtol=0)


def test_draws_follow_the_reference_by_chi_square():
    V, rows, T, fp, pp = 9, 20000, 0.8, 0.7, 0.9
    picker = TokenPicker(SamplingConfig(temperature=T, logit_bias={1: 1.5, 8: -2.0}, frequency_penalty=fp,
                                        presence_penalty=pp))
    counts = torch.zeros(rows, V, dtype=torch.float64)
    for forced in (5, 5, 2):  # every row picked 5 twice and 2 once
        scores = torch.zeros(rows, V)
        scores[:, forced] = 60.0
        picker.pick(scores)
        counts[:, forced] += 1
    scores = torch.linspace(-1.0, 1.5, V).expand(rows, V).contiguous()
    torch.manual_seed(3)
    tok, _, _ = picker.pick(scores)
    want = reference_probs(scores[:1], counts[:1], T, fp, pp, {1: 1.5, 8: -2.0})[0]
    unshifted = torch.softmax(scores[0].double() / T, -1)
    assert (want - unshifted).abs().max() > 0.05  # the shift matters at this size
    ok, stat, threshold = chi_square_ok(torch.bincount(tok, minlength=V), want)
    assert ok, f"chi-square {stat:.1f} >= {threshold:.1f}"


def test_greedy_takes_the_argmax_of_the_shifted_scores():
    picker = TokenPicker(SamplingConfig(temperature=0.0, logit_bias={0: 0.3}, frequency_penalty=1.0))
    scores = torch.tensor([[1.0, 0.9, -5.0, 0.5]])
    # shifted: [1.3, .9, -5, .5] -> 0; [.3, .9, ..] -> 1; [.3, -.1, .., .5] -> 3; [.3, -.1, .., -.5] -> 0
    assert [picker.pick(scores)[0].item() for _ in range(4)] == [0, 1, 3, 0]


def test_a_bias_id_outside_the_scores_is_named():
    picker = TokenPicker(SamplingConfig(logit_bias={12: 1.0}))
    with pytest.raises(ValueError, match="token id 12"):
        picker.pick(torch.zeros(2, 10))


def test_nothing_set_adds_nothing():
    assert TokenPicker(SamplingConfig()).shift is None
    assert TokenPicker(SamplingConfig(logit_bias={3: 0.0}, frequency_penalty=0)).shift is None


# ----------------------------------------------------------------------------- both HF decode loops


def question() -> Rollout:
    return Rollout([Message("You are a helpful assistant.", MessageType.SYSTEM), Message("What is 12 + 35?")])


def sample(model, tok, decode, cfg, n=1, seed=4):
    return ModelGenerate(model, tok, seed=seed,
                         backend=BackendConfig(decode=decode)).generate([question()], n=n, sampling=cfg)[0]


@pytest.mark.parametrize("decode", DECODES)
def test_a_minus_100_bias_never_samples_the_greedy_token(qwen, decode):
    model, tok = qwen
    [greedy] = sample(model, tok, decode, SamplingConfig(max_new_tokens=4, temperature=0.0))
    first = greedy.token_ids[0]
    msgs = sample(model, tok, decode, SamplingConfig(max_new_tokens=8, temperature=1.0, logit_bias={first: -100}),
                  n=24)
    assert all(first not in m.token_ids for m in msgs)
    [biased] = sample(model, tok, decode, SamplingConfig(max_new_tokens=4, temperature=0.0,
                                                         logit_bias={first: -100}))
    assert biased.token_ids[0] != first and biased.sampling == {"logit_bias": {str(first): -100.0}}


@pytest.mark.parametrize("decode", DECODES)
def test_a_plus_100_bias_always_samples_it_and_logprobs_stay_raw(qwen, decode):
    model, tok = qwen
    prompt = encode_prompt(question(), tok)
    with torch.no_grad():
        raw = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    forced = int(raw.argmin())  # the least likely first token
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.8, logit_bias={forced: 100})
    msgs = sample(model, tok, decode, cfg, n=8)
    for m in msgs:
        assert m.token_ids == [forced] * 6 and m.sampling == {"logit_bias": {str(forced): 100.0}}
        ref = reference_logprobs(model, prompt, m.token_ids, 0.8)  # a fresh forward, no bias
        assert ref[0] < -3  # the raw log-prob, not the biased one (near 0)
        torch.testing.assert_close(torch.tensor(m.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


def naive_greedy(model, prompt, steps, eos, fp, pp, bias):
    """float64 reference: greedy over logits + bias - fp * count - pp * (count > 0), a full forward per step."""
    ids: list[int] = []
    with torch.no_grad():
        V = model(input_ids=torch.tensor([prompt])).logits.shape[-1]
        counts = torch.zeros(V, dtype=torch.float64)
        for _ in range(steps):
            z = model(input_ids=torch.tensor([prompt + ids])).logits[0, -1].double()
            for t, b in bias.items():
                z[t] += b
            t = int((z - fp * counts - pp * (counts > 0).double()).argmax())
            ids.append(t)
            counts[t] += 1
            if t in eos:
                break
    return ids


@pytest.mark.parametrize("decode", DECODES)
def test_greedy_penalties_equal_a_float64_reference(qwen, decode):
    model, tok = qwen
    prompt = encode_prompt(question(), tok)
    plain = sample(model, tok, decode, SamplingConfig(max_new_tokens=16, temperature=0.0))[0].token_ids
    assert len(set(plain)) < len(plain)  # the plain greedy reply repeats ids: penalties have work to do
    for fp, pp, bias in [(1.5, 0.0, {}), (0.0, 2.0, {}), (0.6, 0.7, {plain[1]: -3.0}), (-0.3, 0.0, {})]:
        cfg = SamplingConfig(max_new_tokens=16, temperature=0.0, frequency_penalty=fp, presence_penalty=pp,
                             logit_bias=bias)
        [m] = sample(model, tok, decode, cfg)
        want = naive_greedy(model, prompt, 16, {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])},
                            fp, pp, bias)
        assert m.token_ids == want, (fp, pp, bias)
        if fp > 0 or pp > 0:
            assert m.token_ids != plain
        torch.testing.assert_close(torch.tensor(m.logprobs, dtype=torch.float64),
                                   reference_logprobs(model, prompt, m.token_ids, 1.0), atol=1e-4, rtol=0)


def test_sampled_penalties_record_raw_logprobs_and_the_changes(qwen):
    model, tok = qwen
    prompt = encode_prompt(question(), tok)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=30, logit_bias={5: 1.0}, frequency_penalty=0.9,
                         presence_penalty=0.4)
    for m in sample(model, tok, "default", cfg, n=4):
        assert m.temperature == 0.7
        assert m.sampling == {"top_k": 30, "logit_bias": {"5": 1.0}, "frequency_penalty": 0.9,
                              "presence_penalty": 0.4}
        torch.testing.assert_close(torch.tensor(m.logprobs, dtype=torch.float64),
                                   reference_logprobs(model, prompt, m.token_ids, 0.7), atol=1e-4, rtol=0)
    assert sample(model, tok, "default", SamplingConfig(max_new_tokens=2))[0].sampling is None


def test_an_out_of_vocabulary_bias_is_named_before_decoding(qwen):
    model, tok = qwen
    V = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=f"token id {V}"):
        sample(model, tok, "default", SamplingConfig(max_new_tokens=2, logit_bias={V: 1.0}))


# ----------------------------------------------------------------------------- Message.sampling on disk


def shaped_rollout() -> Rollout:
    changes = SamplingConfig(top_p=0.9, logit_bias={30: -100}, presence_penalty=0.5).distribution_changes()
    return Rollout([Message("hi"), Message("ok", MessageType.MODEL, token_ids=[5, 6], logprobs=[-0.5, -1.25],
                                           temperature=0.7, sampling=changes),
                    Message("more"), Message("fine", MessageType.MODEL, token_ids=[7], logprobs=[-0.1])])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_message_sampling_round_trips_through_files(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    r = shaped_rollout()
    assert r.to_dict()["format_version"] == 3
    [back] = load_rollouts(save_rollouts(tmp_path / f"r{suffix}", [r]))
    assert back.messages == r.messages  # sampling included in equality
    assert back[1].sampling == {"top_p": 0.9, "logit_bias": {"30": -100.0}, "presence_penalty": 0.5}
    assert back[3].sampling is None
    copy = r.copy()
    assert copy[1].sampling == r[1].sampling and copy[1].sampling is not r[1].sampling


def test_files_without_sampling_stay_version_1_and_old_records_load():
    plain = Rollout([Message("hi"), Message("ok", MessageType.MODEL, token_ids=[5], logprobs=[-0.5])])
    record = plain.to_dict()
    assert record["format_version"] == 1 and "sampling" not in record["messages"][1]
    assert Rollout.from_dict({**record, "format_version": 2}).messages == plain.messages
    with pytest.raises(ValueError, match="sampling"):  # a version-2 reader's record cannot hold it
        Rollout.from_dict({**record, "format_version": 2,
                           "messages": [record["messages"][0], {**record["messages"][1], "sampling": {"top_k": 3}}]})
    with pytest.raises(TypeError, match="sampling"):
        Message("x", MessageType.MODEL, sampling={3: 1})
    assert Message("x", sampling={"top_k": 3}) != Message("x")


# ----------------------------------------------------------------------------- vLLM (tests/support/fake_vllm.py)


def test_vllm_gets_bias_and_penalties_and_refuses_processed_logprobs(monkeypatch, tmp_path, qwen):
    from SimpleTorchLLMRL.model.generation.vllm import logprobs_mode_problem
    from tests.support.fake_vllm import install_fake_vllm

    vllm = install_fake_vllm(monkeypatch)
    model, tok = qwen
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = vllm.LLM(str(tmp_path))  # raw_logprobs
    seen = []
    real = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, params=None, **kw: seen.append(params) or real(prompts, params,
                                                                                                         **kw))
    gen = ModelGenerate(llm, tok, max_new_tokens=3, temperature=1.0, seed=0)
    cfg = SamplingConfig(max_new_tokens=3, temperature=1.0, logit_bias={"7": -100, 9: 2}, frequency_penalty=0.5,
                         presence_penalty=-0.25)
    [[m]] = gen.generate([question()], sampling=cfg)
    p = seen[-1][0]
    assert (p.logit_bias, p.frequency_penalty, p.presence_penalty) == ({7: -100.0, 9: 2.0}, 0.5, -0.25)
    assert m.sampling == {"logit_bias": {"7": -100.0, "9": 2.0}, "frequency_penalty": 0.5, "presence_penalty": -0.25}
    gen.generate([question()])
    assert (seen[-1][0].logit_bias, seen[-1][0].frequency_penalty, seen[-1][0].presence_penalty) == (None, 0.0, 0.0)
    # processed_logprobs are taken after bias and penalties: refused, greedy included; raw is exact at T = 1
    for c in (cfg, SamplingConfig(do_sample=False, presence_penalty=1.0), SamplingConfig(logit_bias={1: 1.0})):
        assert "processed_logprobs" in logprobs_mode_problem("processed_logprobs", c)
    assert logprobs_mode_problem("raw_logprobs", cfg) is None
    assert logprobs_mode_problem("raw_logprobs", SamplingConfig(do_sample=False, frequency_penalty=1.0)) is None
    assert "temperature" in logprobs_mode_problem("raw_logprobs", SamplingConfig(temperature=0.7,
                                                                                 logit_bias={1: 1.0}))
    processed = ModelGenerate(vllm.LLM(str(tmp_path), logprobs_mode="processed_logprobs"), tok,
                              temperature=0.7)
    with pytest.raises(ValueError, match="processed_logprobs"):
        processed.generate([question()], sampling=SamplingConfig(temperature=0.7, frequency_penalty=0.5))


# ----------------------------------------------------------------------------- the gateway, through the openai SDK


@pytest.fixture(scope="module")
def recorded_gateway(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from SimpleTorchLLMRL.gateway import Gateway
    from tests.support.gateway_helpers import load_calc

    model, tok = load_calc()
    path = tmp_path_factory.mktemp("gateway") / "rollouts.jsonl"
    gw = Gateway(ModelGenerate(model, tok, max_new_tokens=6, temperature=1.0,
                               seed=0), record_to=path, window=0.01)
    with gw.serve() as url:
        yield gw, url, path


def test_the_gateway_honours_logit_bias_and_records_it(recorded_gateway):
    import openai

    from tests.support.gateway_helpers import start

    gw, url, path = recorded_gateway

    def greedy(key, **kw):
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        r = client.chat.completions.create(model="policy", messages=start(), temperature=0, max_tokens=6,
                                           extra_body={"return_token_ids": True}, **kw)
        [m] = [m for r_ in gw.rollouts(key) for m in r_ if m.type is MessageType.MODEL]
        assert m.token_ids == r.choices[0].model_extra["token_ids"]
        return m

    plain = greedy("plain")
    first = plain.token_ids[0]
    biased = greedy("biased", logit_bias={str(first): -100})
    assert biased.token_ids[0] != first and first not in biased.token_ids
    assert plain.sampling is None and biased.sampling == {"logit_bias": {str(first): -100.0}}
    penalized = greedy("penalized", frequency_penalty=2, presence_penalty=1.5)
    assert penalized.sampling == {"frequency_penalty": 2.0, "presence_penalty": 1.5}
    direct = gw.generator.generate([Rollout([Message(t["content"], MessageType.from_role(t["role"]))
                                             for t in start()])],
                                   sampling=SamplingConfig(max_new_tokens=6, temperature=0.0, frequency_penalty=2,
                                                           presence_penalty=1.5))[0][0]
    assert penalized.token_ids == direct.token_ids  # the same settings as a direct call
    with pytest.raises(openai.BadRequestError) as e:  # an id the tokenizer does not have
        openai.OpenAI(base_url=url, api_key="bad", max_retries=0).chat.completions.create(
            model="policy", messages=start(), logit_bias={str(len(gw.generator.tokenizer)): 5})
    assert e.value.param == "logit_bias" and "vocabulary" in e.value.message
    gw.close()  # the open rollouts go to record_to
    recorded = {json.dumps(m.sampling, sort_keys=True) for r in load_rollouts(path) for m in r
                if m.type is MessageType.MODEL}
    assert recorded == {"null", json.dumps(biased.sampling, sort_keys=True),
                        json.dumps(penalized.sampling, sort_keys=True)}


def test_text_completions_honour_logit_bias(recorded_gateway):
    import openai

    _, url, _ = recorded_gateway
    client = openai.OpenAI(base_url=url, api_key="text", max_retries=0)
    kw = dict(model="policy", prompt="What is 12 + 35?", temperature=0, max_tokens=4,
              extra_body={"return_token_ids": True})
    first = client.completions.create(**kw).choices[0].model_extra["token_ids"][0]
    ids = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0].model_extra["token_ids"]
    assert first not in ids
