"""The vLLM backend against tests/support/fake_vllm.py (CPU), plus one real-vLLM test that needs CUDA."""

import importlib.util
import sys

import pytest
import torch

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import encode_prompt, encode_rollout
from SimpleTorchLLMRL.model.generation.generator import BackendConfig, ModelGenerate
from SimpleTorchLLMRL.model.generation.sampling import DecodeWatch, SamplingConfig
from SimpleTorchLLMRL.model.generation.vllm import logprobs_mode_problem, push_weights
from SimpleTorchLLMRL.testing.tiny import tiny_model
from tests.support.generation_helpers import make_generator, peaked, reference_logprobs


@pytest.fixture(scope="module")
def policy(tok):
    return peaked(tiny_model("qwen2", tok), seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok, policy):
    d = tmp_path_factory.mktemp("tiny-qwen2")
    policy.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def rollouts(n=3):
    texts = ["What is 12 + 35?", "hi", "def f(x):"]
    return [Rollout([Message("Be brief.", MessageType.SYSTEM), Message(t)]) for t in texts[:n]]


def test_missing_vllm_says_how_to_install(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="uv sync --extra vllm"):
        ModelGenerate("some/model", tok, backend="vllm")


def test_greedy_matches_the_hf_backend(vllm, tok, policy, model_dir):
    llm = vllm.LLM(model_dir)
    kw = dict(max_new_tokens=10, do_sample=False, temperature=1.0, stop=["ction"])
    hf = make_generator(policy, tok, **kw).generate(rollouts())
    fast_gen = make_generator(llm, tok, **kw)
    fast = fast_gen.generate(rollouts())
    assert fast_gen.backend.__class__.__name__ == "VLLMBackend"
    for (h,), (v,) in zip(hf, fast, strict=True):
        assert v.token_ids == h.token_ids and v.finish_reason == h.finish_reason and v.content == h.content
        torch.testing.assert_close(torch.tensor(v.logprobs), torch.tensor(h.logprobs), atol=1e-4, rtol=0)
        assert v.temperature == 1.0


@pytest.mark.parametrize("mode, temperature, top_k", [("processed_logprobs", 0.7, None), ("raw_logprobs", 1.0, None),
                                                     ("processed_logprobs", 1.0, 5), ("processed_logprobs", 0.7, 5)])
def test_sampled_logprobs_are_of_the_distribution_drawn_from(vllm, tok, policy, model_dir, mode, temperature, top_k):
    llm = vllm.LLM(model_dir, logprobs_mode=mode, seed=0)
    gen = ModelGenerate(llm, tok, seed=1,
                        sampling=SamplingConfig(max_new_tokens=8, temperature=temperature, top_k=top_k))
    rs = rollouts(2)
    for r, group in zip(rs, gen.generate(rs, n=2), strict=True):
        assert len(group) == 2 and group[0].token_ids != group[1].token_ids
        for msg in group:
            assert msg.temperature == temperature
            ref = reference_logprobs(policy, encode_prompt(r, tok), msg.token_ids, temperature)
            if top_k:  # a top-k turn records the log-prob renormalized over the top k (vLLM's processed ones)
                ref = ref - top_k_mass(policy, encode_prompt(r, tok), msg.token_ids, temperature, top_k)
                assert msg.sampling == {"top_k": top_k}
            torch.testing.assert_close(torch.tensor(msg.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)
            enc = encode_rollout(r.copy().add_messages(msg), tok)  # the prefix invariant holds for vLLM too
            p = encode_prompt(r, tok)
            assert enc.input_ids[: len(p) + len(msg.token_ids)] == p + msg.token_ids


def top_k_mass(model, prompt, ids, temperature, k):
    """(N,) float64 log of the softmax(logits / T) mass of each step's top k."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].double()  # (N, V)
    logp = torch.log_softmax(logits / temperature, -1)
    return torch.logsumexp(logp.topk(k, -1).values, -1)


def test_request_shape_sent_to_vllm(vllm, tok, model_dir, monkeypatch):
    llm = vllm.LLM(model_dir, logprobs_mode="processed_logprobs")
    seen = {}
    real = llm.generate

    def spy(prompts, sampling_params=None, **kw):
        seen.update(prompts=prompts, params=sampling_params, kw=kw)
        return real(prompts, sampling_params, **kw)

    monkeypatch.setattr(llm, "generate", spy)
    gen = ModelGenerate(llm, tok, seed=5,
                        sampling=SamplingConfig(max_new_tokens=4, temperature=0.9, top_p=1.0, stop=["x"],
                                                tool_call_stop=["</tool_call>"]))
    gen.generate(rollouts(2), n=3, seed=[40, 7])
    assert seen["prompts"] == [{"prompt_token_ids": encode_prompt(r, tok)} for r in rollouts(2)]
    sp = seen["params"]
    assert [p.n for p in sp] == [3, 3] and [p.seed for p in sp] == [40, 7]  # each prompt its own seed
    p = sp[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (0.9, 1.0, 0, 4, 0)
    assert p.stop == ["x", "</tool_call>"] and p.include_stop_str_in_output and p.stop_token_ids == [tok.eos_token_id]
    assert seen["kw"]["lora_request"] is None and seen["kw"]["use_tqdm"] is False


def test_finish_reasons_from_completion_outputs(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    base = ModelGenerate(llm, tok,
                         sampling=SamplingConfig(max_new_tokens=12,
                                                 do_sample=False)).generate(rollouts(1))[0][0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop = tok.decode(base.token_ids[3:5], skip_special_tokens=True)
    tool = ModelGenerate(llm, tok,
                         sampling=SamplingConfig(max_new_tokens=12, do_sample=False,
                                                 tool_call_stop=[stop])).generate(rollouts(1))[0][0]
    assert tool.finish_reason == "tool_call" and tool.content.endswith(stop) and len(tool.token_ids) <= 5
    eos = ModelGenerate(llm, tok,
                        sampling=SamplingConfig(max_new_tokens=12, do_sample=False,
                                                eos_token_ids=[base.token_ids[2]]))
    msg = eos.generate(rollouts(1))[0][0]
    assert msg.finish_reason == "stop" and msg.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[2]) + 1]


def _fields(groups) -> list:
    return [[(m.token_ids, m.logprobs, m.finish_reason, m.content) for m in g] for g in groups]


@pytest.mark.parametrize("kw", [dict(temperature=1.0, stop=["ction"]), dict(do_sample=False)])
def test_a_watched_call_steps_the_engine_and_samples_what_an_unwatched_one_does(vllm, tok, model_dir, kw):
    """n = 2 as one request of n (sampling) or two repeated requests (greedy): same samples, ids reached the
    watch one step at a time, and together they are each row's ids."""
    llm = vllm.LLM(model_dir)
    gen = make_generator(llm, tok, max_new_tokens=10, seed=0, **kw)
    plain = gen.generate(rollouts(2), n=2, seed=7)
    seen: dict[int, list[list[int]]] = {}
    watched = gen.generate(rollouts(2), n=2, seed=7, watch=DecodeWatch(
        lambda rows, ids: [seen.setdefault(r, []).append(i) for r, i in zip(rows, ids, strict=True)]))
    assert _fields(watched) == _fields(plain) and len(llm.generate_calls) == 1  # the watched one stepped
    assert {r: sum(parts, []) for r, parts in seen.items()} == {2 * i + j: m.token_ids for i, g in enumerate(plain)
                                                                for j, m in enumerate(g)}
    assert all(len(part) == 1 for parts in seen.values() for part in parts)  # the fake engine: one id per step


def test_a_row_the_watch_gives_up_is_aborted_and_keeps_what_it_sampled(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    gen = ModelGenerate(llm, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=10, temperature=1.0, eos_token_ids=[10**6]))
    plain = gen.generate(rollouts(2), n=2, seed=3)
    got = {r: 0 for r in range(4)}

    def on_tokens(rows, ids):
        for r, new in zip(rows, ids, strict=True):
            got[r] += len(new)

    watch = DecodeWatch(on_tokens, lambda r: r == 1 and got[1] >= 3)  # prompt 0's 2nd sample, after 3 ids
    watched = gen.generate(rollouts(2), n=2, seed=3, watch=watch)
    cut = watched[0][1]
    assert watch.given_up_at(1) == 3 and got[1] == 3 and not llm.llm_engine.has_unfinished_requests()
    assert (cut.token_ids, cut.logprobs) == (plain[0][1].token_ids[:3], plain[0][1].logprobs[:3])
    assert cut.finish_reason == "length" and cut.content == tok.decode(cut.token_ids, skip_special_tokens=True)
    assert _fields([watched[0][:1], watched[1]]) == _fields([plain[0][:1], plain[1]])
    assert [watch.given_up_at(r) for r in (0, 2, 3)] == [None, None, None]


def test_a_watched_call_that_fails_leaves_no_request_in_the_engine(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    gen = ModelGenerate(llm, tok, seed=0,
                        sampling=SamplingConfig(max_new_tokens=10, temperature=1.0, eos_token_ids=[10**6]))
    calls = []

    def on_tokens(rows, ids):
        calls.append(rows)
        if len(calls) == 2:
            raise RuntimeError("the watch broke")

    with pytest.raises(RuntimeError, match="the watch broke"):
        gen.generate(rollouts(2), n=2, watch=DecodeWatch(on_tokens))
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(gen.generate(rollouts(1), watch=DecodeWatch())[0][0].token_ids) == 10  # the engine still serves


def test_greedy_group_repeats_prompts_instead_of_n(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    groups = ModelGenerate(llm, tok,
                           sampling=SamplingConfig(max_new_tokens=4,
                                                   do_sample=False)).generate(rollouts(2), n=2)
    assert [[m.token_ids == g[0].token_ids for m in g] for g in groups] == [[True, True], [True, True]]
    assert llm.generate_calls[-1]["n_prompts"] == 4


@pytest.mark.parametrize("mode, kw", [
    ("raw_logprobs", dict(temperature=0.7)), ("raw_logprobs", dict(temperature=1.0, top_p=0.9)),
    ("processed_logprobs", dict(sampling=SamplingConfig(temperature=1.0, top_k=5, logit_bias={3: 1.0}))),
    ("raw_logits", dict(temperature=1.0)),
])
def test_logprobs_mode_that_cannot_give_the_right_quantity_is_refused(vllm, tok, model_dir, mode, kw):
    with pytest.raises(ValueError, match="logprobs_mode|top_k/top_p"):
        make_generator(vllm.LLM(model_dir, logprobs_mode=mode), tok, **kw)


def test_logprobs_mode_rules():
    ok = [("processed_logprobs", SamplingConfig(temperature=0.7, top_k=5)), ("processed_logprobs", SamplingConfig()),
          ("raw_logprobs", SamplingConfig(temperature=1.0, top_k=5, logit_bias={3: 1.0})),
          ("raw_logprobs", SamplingConfig(do_sample=False, temperature=0.3))]
    assert all(logprobs_mode_problem(m, c) is None for m, c in ok)


def test_model_path_builds_the_engine_with_the_needed_mode(vllm, tok, model_dir):
    gen = ModelGenerate(model_dir, None, temperature=0.6,
                        backend=BackendConfig(kind="vllm", vllm_kwargs=dict(enable_sleep_mode=True)))
    assert gen.backend.llm.model_config.logprobs_mode == "processed_logprobs"
    assert gen.tokenizer.eos_token_id == tok.eos_token_id and gen.max_context == 512


def test_prompt_over_max_model_len_names_the_rollout(vllm, tok, model_dir):
    gen = ModelGenerate(vllm.LLM(model_dir, max_model_len=40), tok, max_new_tokens=8, temperature=1.0)
    long = Rollout([Message("The quick brown fox jumps over the lazy dog. " * 3)])
    with pytest.raises(ValueError, match="prompt 1"):
        gen.generate([rollouts(1)[0], long])


# ----------------------------------------------------------------------------- weight sync


def greedy(gen_model, tok):
    return [g[0].token_ids for g in ModelGenerate(gen_model, tok,
                                                  sampling=SamplingConfig(max_new_tokens=8,
                                                                          do_sample=False)).generate(rollouts())]


def test_push_full_weights(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    other = peaked(tiny_model("qwen2", tok), seed=1)
    assert greedy(llm, tok) != greedy(other, tok)
    ModelGenerate(llm, tok, sampling=SamplingConfig(do_sample=False)).push_weights(other, mode="full")
    assert greedy(llm, tok) == greedy(other, tok) and llm.prefix_cache_resets >= 1
    assert llm._vllm_model.load_calls == 1 and llm.llm_engine._worker.reload_calls == 1


def test_push_sends_a_callable_when_the_engine_is_in_another_process(vllm, tok, model_dir, monkeypatch):
    import functools
    import pickle

    llm = vllm.LLM(model_dir)
    monkeypatch.delattr(llm.llm_engine, "model_executor")  # V1 multiprocess: no in-process executor
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1 set before the engine starts"):
        push_weights(llm, tiny_model("qwen2", tok))
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    sent = []
    real = llm.collective_rpc
    monkeypatch.setattr(llm, "collective_rpc", lambda m, *a, **k: sent.append(m) or real(m, *a, **k))
    other = peaked(tiny_model("qwen2", tok), seed=1)
    push_weights(llm, other)
    assert len(sent) == 1 and isinstance(sent[0], functools.partial)  # tensors travel with the callable
    pickle.loads(pickle.dumps(sent[0]))  # what a multi-process engine does with it
    assert greedy(llm, tok) == greedy(other, tok)


def lora_policy(tok, seed):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    return get_peft_model(peaked(tiny_model("qwen2", tok), seed=0), cfg)


def test_push_merged_peft_weights_leaves_the_model_untouched(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    peft_model = lora_policy(tok, 2)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    want = greedy(peft_model, tok)
    assert greedy(llm, tok) != want
    push_weights(llm, peft_model)  # KeyError here if a peft prefix or lora_ tensor leaked through
    assert greedy(llm, tok) == want
    after = peft_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the training model is never modified


def test_push_adapter_serves_it_through_lora_requests(vllm, tok, model_dir):
    peft_model = lora_policy(tok, 3)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        gen = ModelGenerate(vllm.LLM(model_dir), tok,
                            sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
        gen.push_weights(peft_model, mode="adapter")
        gen.generate(rollouts())
    llm = vllm.LLM(model_dir, enable_lora=True)
    gen = ModelGenerate(llm, tok, sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
    gen.push_weights(peft_model, mode="adapter")
    first = gen.backend.lora_request
    assert [g[0].token_ids for g in gen.generate(rollouts())] == greedy(peft_model, tok)
    gen.push_weights(peft_model, mode="adapter")
    assert gen.backend.lora_request.lora_int_id == first.lora_int_id + 1  # a new id: vLLM caches adapters by id


def test_sleep_wake_and_push_for_colocation(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir, enable_sleep_mode=True)
    gen = ModelGenerate(llm, tok, sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
    want = greedy(llm, tok)
    gen.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        gen.generate(rollouts())
    gen.wake_up(["weights"])
    gen.push_weights(peaked(tiny_model("qwen2", tok), seed=0))  # level 2 discarded the weights
    gen.wake_up(["kv_cache"])
    assert greedy(llm, tok) == want
    with pytest.raises(ValueError, match="mode"):
        gen.push_weights(peaked(tiny_model("qwen2", tok)), mode="lora")


# ----------------------------------------------------------------------------- real vLLM (GPU only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs CUDA and the vllm extra (uv sync --extra vllm)")
def test_real_vllm_logprobs_and_weight_push(tmp_path, tok):
    import vllm

    hf = peaked(tiny_model("qwen2", tok, hidden_size=128, num_heads=2), seed=0)
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = vllm.LLM(str(tmp_path), dtype="float32", logprobs_mode="processed_logprobs", enforce_eager=True,
                   gpu_memory_utilization=0.2, max_model_len=512, seed=0)
    gen = ModelGenerate(llm, tok, max_new_tokens=12, temperature=0.7, seed=0)
    rs = rollouts()
    for r, (msg,) in zip(rs, gen.generate(rs), strict=True):
        ref = reference_logprobs(hf, encode_prompt(r, tok), msg.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(msg.logprobs, dtype=torch.float64), ref, atol=2e-3, rtol=0)
    other = peaked(tiny_model("qwen2", tok, hidden_size=128, num_heads=2), seed=1)
    gen_greedy = ModelGenerate(llm, tok, sampling=SamplingConfig(max_new_tokens=8, do_sample=False))
    gen_greedy.push_weights(other)
    want = [g[0].token_ids for g in ModelGenerate(other, tok,
                                                  sampling=SamplingConfig(max_new_tokens=8,
                                                                          do_sample=False)).generate(rs)]
    assert [g[0].token_ids for g in gen_greedy.generate(rs)] == want


def test_decode_is_the_hf_backends_choice(vllm, tok, model_dir):
    llm = vllm.LLM(model_dir)
    assert ModelGenerate(llm, tok, temperature=1.0, backend=BackendConfig(decode="auto")).backend.llm is llm
    with pytest.raises(ValueError, match="decode / batch_size choose the HF backend's decode loop"):
        ModelGenerate(llm, tok, temperature=1.0, backend=BackendConfig(decode="fast"))
