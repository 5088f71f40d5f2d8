"""The arithmetic task (problems, splits, answer checking, calculator) and the embedded tiny_calc model."""

import json
import operator
import random
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.chat.message import MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import as_sampled, encode_prompt, encode_rollout
from SimpleTorchLLMRL.recipes.calculator import arithmetic as A
from SimpleTorchLLMRL.tools import CalculatorError, evaluate
from SimpleTorchLLMRL.tools.base import format_number
from tests.support.examples_helpers import load_example

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "SimpleTorchLLMRL" / "assets" / "tiny_calc"
PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


# ------------------------------------------------------------------ problems and splits


def test_problems_are_seeded_unique_and_in_range():
    a = A.generate_problems(300, seed=3, split="train")
    assert a == A.generate_problems(300, seed=3, split="train")
    assert a != A.generate_problems(300, seed=4, split="train")
    assert len({p.expression for p in a}) == 300
    for p in a:
        assert 10 <= p.a <= 999 and 10 <= p.b <= 999 and p.op in A.OPS
        assert p.answer == PY_OPS[p.op](p.a, p.b)
        assert p.expression in p.question
    assert {p.op for p in a} == set(A.OPS)


def test_splits_are_disjoint_and_about_one_in_five():
    train = {p.expression for p in A.generate_problems(2000, seed=0, split="train")}
    test = {p.expression for p in A.generate_problems(500, seed=0, split="test")}
    assert not train & test
    assert all(A.split_of(e) == "train" for e in train) and all(A.split_of(e) == "test" for e in test)
    rng = random.Random(1)
    drawn = [A.random_problem(rng) for _ in range(4000)]
    frac = sum(p.split == "test" for p in drawn) / len(drawn)
    assert 0.17 < frac < 0.23
    assert A.split_of("47  *   23") == A.split_of("47 * 23")  # whitespace does not move a problem


def test_dataset_rows_roundtrip_jsonl(tmp_path):
    rows = A.build_dataset(25, seed=1, split="test")
    path = A.write_jsonl(rows, tmp_path / "d.jsonl")
    back = [json.loads(line) for line in path.read_text().splitlines()]
    assert back == rows and len(back) == 25
    for row in back:
        assert set(row) == {"question", "answer"} and isinstance(row["answer"], str)
        expr = row["question"].split(" ", 2)[-1].rstrip("?.") if row["question"].startswith("What") \
            else row["question"].split(" ", 1)[1].rstrip(".")
        assert int(row["answer"]) == A.safe_eval(expr)


@pytest.mark.parametrize("bad", [dict(split="dev"), dict(ops=("/",)), dict(ops=()), dict(min_digits=4, max_digits=2)])
def test_bad_generator_arguments_raise(bad):
    with pytest.raises(ValueError):
        A.generate_problems(1, **bad)


def test_problem_validates_op():
    with pytest.raises(ValueError, match="op"):
        A.Problem(1, "/", 2)


# ------------------------------------------------------------------ calculator and answers


def test_safe_eval_matches_python_arithmetic():
    rng = random.Random(0)
    for _ in range(200):
        x, y, z = (rng.randint(-999, 999) for _ in range(3))
        o1, o2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"({x}) {o1} {y} {o2} ({z})"
        want = PY_OPS[o2](PY_OPS[o1](x, y), z) if o2 in "+-" or o1 == "*" else PY_OPS[o1](x, y * z)
        assert A.safe_eval(expr) == want, expr


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 8", "7 / 2", "a + 1", "1.5 + 2", "", "1 +",
                                  "9" * 30 + " * 99", "(1)" * 100, "[1] * 3", "True + 1"])
def test_safe_eval_rejects_everything_else(expr):
    with pytest.raises(ValueError):
        A.safe_eval(expr)


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 8", "7 / 2", "a + 1", "", "1 +", "(1)" * 100,
                                  "47 * 23", "(-3) * (4 - 9)"])
def test_run_calculator_answers_as_the_calculator_tool_does(expr):
    """Warm-up solutions show the same TOOL text that the calculator tool gives during RL."""
    try:
        want = format_number(evaluate(expr))
    except CalculatorError as e:
        want = f"Error: {e}"
    assert A.run_calculator(expr) == want


@pytest.mark.parametrize("text,answer,ok", [
    ("\\boxed{1081}", "1081", True),
    ("so \\boxed{12} no wait \\boxed{1,081}", 1081, True),
    ("\\boxed{ -24 }", "-24", True),
    ("\\boxed{1081.0}", "1081", True),
    ("\\boxed{1082}", "1081", False),
    ("1081", "1081", False),
    ("\\boxed{}", "0", False),
    ("\\boxed{10a}", "10", False),
])
def test_check_answer(text, answer, ok):
    assert A.check_answer(text, answer) is ok


def test_tool_call_roundtrip_and_malformed_calls():
    text = A.format_tool_call("47 * 23")
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "47 * 23"}}\n</tool_call>'
    assert A.parse_tool_call("sure " + text + " done") == "47 * 23"
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"name": "search", "arguments": '
                '{"expression": "1"}}</tool_call>', '<tool_call>{"name": "calculator"}</tool_call>',
                '<tool_call>{"name": "calculator", "arguments": {"expression": 3}}</tool_call>', "no call"]:
        assert A.parse_tool_call(bad) is None


def test_calculator_schema_is_the_calculator_tools_schema():
    from SimpleTorchLLMRL.tools import calculator

    assert calculator.schema == A.CALCULATOR_SCHEMA
    assert calculator.run({"expression": "47 * 23"}) == A.run_calculator("47 * 23") == "1081"


def test_solution_rollout_masks_only_the_assistant_turns(chatml_tokenizer):
    r = A.solution_rollout("What is 47 * 23?", use_tool=True, expression="47 * 23", tools=[A.CALCULATOR_SCHEMA])
    assert [m.type for m in r] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL, MessageType.TOOL,
                                   MessageType.MODEL]
    assert r[3].content == "1081" and r[4].content == "\\boxed{1081}" and r.metadata["tools"]
    enc = encode_rollout(r, chatml_tokenizer)
    trained = chatml_tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])
    assert trained == A.format_tool_call("47 * 23") + "<|im_end|>" + "\\boxed{1081}<|im_end|>"
    direct = A.solution_rollout("What is 47 * 23?", use_tool=False, final_answer=1000, system_prompt=None)
    assert [m.type for m in direct] == [MessageType.MESSAGE, MessageType.MODEL] and not direct.metadata
    assert direct[-1].content == "\\boxed{1000}"
    with pytest.raises(ValueError, match="expression"):
        A.solution_rollout("q", use_tool=True)
    with pytest.raises(ValueError, match="final_answer"):
        A.solution_rollout("q", use_tool=False)


def test_used_tool_and_rollout_correct():
    tool = A.solution_rollout("What is 47 * 23?", use_tool=True, expression="47 * 23")
    tool.metadata["answer"] = "1081"
    direct = A.solution_rollout("What is 47 * 23?", use_tool=False, final_answer=1080)
    assert A.used_tool(tool) and not A.used_tool(direct)
    assert A.rollout_correct(tool) and A.rollout_correct(tool, 1081) and not A.rollout_correct(tool, 1080)
    assert A.rollout_correct(direct, "1080") and not A.rollout_correct(direct)  # no answer in metadata
    assert not A.rollout_correct(Rollout(A.prompt_messages("q")), "1")  # no MODEL turn yet


# ------------------------------------------------------------------ the embedded model

needs_asset = pytest.mark.skipif(not (ASSET / "model.safetensors").exists(), reason="tiny_calc asset not built")


@pytest.fixture(scope="module")
def tiny_calc():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(ASSET).eval(), AutoTokenizer.from_pretrained(ASSET)


@needs_asset
def test_asset_is_small_and_loads_with_its_template(tiny_calc):
    from SimpleTorchLLMRL.testing.tiny import CHATML_TEMPLATE

    model, tok = tiny_calc
    size = sum(f.stat().st_size for f in ASSET.iterdir() if f.is_file())
    assert size < 8e6
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "tokenizer.json"} <= {
        f.name for f in ASSET.iterdir()}
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok)
    ids = tok("1081 - 24", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()] == ["108", "1", "24"]  # 3-digit chunks
    assert tok.decode(ids) == "1081 - 24"
    # AutoTokenizer kept the saved pre-tokenizer (no model-specific override)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 47 * 23?"}], tools=[A.CALCULATOR_SCHEMA],
                                   tokenize=False, add_generation_prompt=True)
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids


def _greedy(model, tok, rollout: Rollout, max_new_tokens=40) -> str:
    ids = torch.tensor([encode_prompt(rollout, tok)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@needs_asset
def test_asset_knows_the_format_and_copies_tool_results(tiny_calc):
    model, tok = tiny_calc
    problems = A.generate_problems(12, seed=7, split="test")
    for p in problems:
        first = _greedy(model, tok, Rollout(A.prompt_messages(p.question), {"tools": [A.CALCULATOR_SCHEMA]}))
        assert A.extract_boxed(first) is not None or A.parse_tool_call(first) == p.expression, first
    copied = 0
    for p in problems:  # after a calculator call the answer is the tool's result
        r = A.solution_rollout(p.question, use_tool=True, expression=p.expression, tools=[A.CALCULATOR_SCHEMA])
        r.messages.pop()
        copied += A.check_answer(_greedy(model, tok, as_sampled(r, tok)), p.answer)  # the tool call as sampled
    assert copied >= 11


# ------------------------------------------------------------------ the pretraining script


@pytest.mark.slow
def test_pretrain_script_builds_a_loadable_model_reproducibly(tmp_path):
    mod = load_example("pretrain_tiny")
    small = ["--examples", "300", "--steps", "3", "--batch-size", "8", "--hidden", "32", "--layers", "1",
             "--heads", "2", "--vocab-size", "2304", "--eval-problems", "3", "--eval-sampled", "2", "--samples", "2"]
    for name in ("m1", "m2"):
        mod.main(["--out", str(tmp_path / name), *small])
    out = tmp_path / "m1"
    assert "examples/pretrain_tiny.py" in (out / "README.md").read_text()
    for f in ("model.safetensors", "tokenizer.json", "config.json"):  # seeded: the same bytes twice
        assert (out / f).read_bytes() == (tmp_path / "m2" / f).read_bytes(), f
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.hidden_size == 32 and len(tok) == 2304
    assert [len(tok(d, add_special_tokens=False)["input_ids"]) for d in ("7", "42", "999", "007")] == [1] * 4
    r = A.solution_rollout("What is 12 + 30?", use_tool=True, expression="12 + 30", tools=[A.CALCULATOR_SCHEMA])
    enc = encode_rollout(as_sampled(r, tok), tok)  # as the generator would have produced it
    assert tok.decode(enc.input_ids) == tok.apply_chat_template(r.to_chat(), tools=r.metadata["tools"],
                                                                tokenize=False).rstrip("\n")
