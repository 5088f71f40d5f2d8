"""The seed's README still runs: each Python snippet it showed, as written, in order, in one namespace.

The seed README (the project's first published README) taught these import paths and calls; users copied
them. Only what cannot run here is replaced, each replacement listed in SUBSTITUTIONS: "gpt2" from the hub
becomes the embedded tiny model (TINY_CALC, loaded with the Auto classes since it is not a GPT-2), and the
names the seed left to the reader (`model`, `tokenizer`, `dataset`, `question`, `answer`, `rewards`,
`optimizer`) are defined by a prelude. The assertions after the snippets say what each one should have done.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from SimpleTorchLLMRL.testing.tiny import TINY_CALC

# The seed README's python blocks, in its order, verbatim (comments trimmed).
SEED_SNIPPETS = {
    "the rollout system": '''
from SimpleTorchLLMRL.chat.message import Rollout, Message, MessageType

rollout = Rollout()
rollout.add_messages(Message("You are a helpful math tutor", MessageType.SYSTEM))
rollout.add_messages(Message("What is 2 + 3?", MessageType.MESSAGE))
rollout.add_messages(Message("2 + 3 = 5", MessageType.MODEL))
''',
    "message types": '''
MessageType.SYSTEM
MessageType.MESSAGE
MessageType.MODEL
''',
    "model generation": '''
from SimpleTorchLLMRL.model.generate import ModelGenerate

generator = ModelGenerate(
    model=model,
    tokenizer=tokenizer,
    max_new_tokens=100,
    temperature=0.7
)

response = generator.rollout_generate_response(rollout)

generator.batch_rollout_generate_response(rollouts)
''',
    "training with GRPO": '''
from SimpleTorchLLMRL.trainer.GRPO import GRPO

trainer = GRPO(
    model=model,
    tokenizer=tokenizer,
    eps=0.2
)

loss = trainer.calculate_loss(rollouts=rollouts, rewards=rewards)
loss.backward()
optimizer.step()
''',
    "reward functions": '''
from SimpleTorchLLMRL.reward.boxed import BoxedReward

reward_fn = BoxedReward()
rewards = reward_fn(rollouts, ground_truths)
''',
    "environments": '''
from SimpleTorchLLMRL.env.QASolve import QASolverEnv

env = QASolverEnv(custom_sys_prompt="Solve this math problem:")
initial_messages, state = env.setup(question, answer)
''',
    "quick start": '''
import torch
from transformers import GPT2LMHeadModel, GPT2Tokenizer
from SimpleTorchLLMRL.chat.message import Rollout, Message, MessageType
from SimpleTorchLLMRL.model.generate import ModelGenerate
from SimpleTorchLLMRL.trainer.GRPO import GRPO
from SimpleTorchLLMRL.reward.boxed import BoxedReward

model = GPT2LMHeadModel.from_pretrained("gpt2")
tokenizer = GPT2Tokenizer.from_pretrained("gpt2")
tokenizer.pad_token = tokenizer.eos_token

generator = ModelGenerate(model=model, tokenizer=tokenizer)
trainer = GRPO(model=model, tokenizer=tokenizer, eps=0.2)
reward_fn = BoxedReward()
optimizer = torch.optim.Adam(model.parameters())

rollouts = []
ground_truths = []

for question, answer in dataset:
    rollout = Rollout()
    rollout.add_messages(Message("Solve this problem:", MessageType.SYSTEM))
    rollout.add_messages(Message(question, MessageType.MESSAGE))

    response = generator.rollout_generate_response(rollout)
    rollout.add_messages(response)

    rollouts.append(rollout)
    ground_truths.append(answer)

rewards = reward_fn(rollouts, ground_truths)
loss = trainer.calculate_loss(rollouts, rewards)

optimizer.zero_grad()
loss.backward()
optimizer.step()
''',
    "tool integration": '''
rollout.add_messages(Message("calculate(2 + 3)", MessageType.MODEL))
rollout.add_messages(Message("Result: 5", MessageType.SYSTEM))
rollout.add_messages(Message("The answer is 5", MessageType.MODEL))
''',
    "multi-agent": '''
rollout.add_messages(Message("I think the answer is 4", MessageType.MODEL))
rollout.add_messages(Message("Actually, let me double-check that calculation...", MessageType.MODEL))
rollout.add_messages(Message("calculate(2 + 3)", MessageType.MODEL))
rollout.add_messages(Message("Result: 5", MessageType.SYSTEM))
rollout.add_messages(Message("The correct answer is 5", MessageType.MODEL))
''',
}

# What cannot run here (a hub download), and what it becomes: (seed line, line run instead).
SUBSTITUTIONS = [
    ('model = GPT2LMHeadModel.from_pretrained("gpt2")', "model = AutoModelForCausalLM.from_pretrained(TINY_CALC)"),
    ('tokenizer = GPT2Tokenizer.from_pretrained("gpt2")', "tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)"),
]

# The names the seed's snippets take as given.
PRELUDE = '''
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(TINY_CALC)
tokenizer = AutoTokenizer.from_pretrained(TINY_CALC)
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
dataset = [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
question, answer = dataset[0]
'''


def run_seed_readme() -> dict:
    ns = {"TINY_CALC": TINY_CALC, "__name__": "seed_readme"}
    exec(PRELUDE, ns)
    for title, code in SEED_SNIPPETS.items():
        if title == "model generation":  # the seed's "rollouts" here: copies of the rollout so far
            ns["rollouts"] = [ns["rollout"].copy(), ns["rollout"].copy()]
        if title == "training with GRPO":
            ns["rewards"] = torch.tensor([1.0, 0.0])
        if title == "reward functions":
            ns["ground_truths"] = ["5", "5"]
        for seed_line, here in SUBSTITUTIONS:
            code = code.replace(seed_line, here)
        exec(compile(code, f"seed README: {title}", "exec"), ns)
        ns.setdefault("done", []).append(title)
    return ns


@pytest.fixture(scope="module")
def seed_run():
    return run_seed_readme()


def test_every_seed_snippet_runs(seed_run):
    assert seed_run["done"] == list(SEED_SNIPPETS)


def test_each_substitution_replaces_a_line_the_seed_shows():
    shown = "\n".join(SEED_SNIPPETS.values())
    assert all(seed_line in shown for seed_line, _ in SUBSTITUTIONS)


def test_the_seed_snippets_did_what_they_say(seed_run):
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout

    rollouts, rewards, loss = seed_run["rollouts"], seed_run["rewards"], seed_run["loss"]
    assert [type(r) for r in rollouts] == [Rollout, Rollout]  # the quick start's two questions
    assert [m.type for m in rollouts[0]] == [MessageType.SYSTEM, MessageType.MESSAGE, MessageType.MODEL]
    assert rollouts[1] is seed_run["rollout"]  # the loop's last rollout, which the later snippets extend
    sampled = rollouts[0][-1]  # as sampled: the ids and log-probs the trainer uses
    assert sampled.token_ids and len(sampled.logprobs) == len(sampled.token_ids)
    assert rewards.shape == (2,) and rewards.dtype == torch.float32
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert isinstance(seed_run["response"], Message) and seed_run["response"].type is MessageType.MODEL
    initial, state = seed_run["initial_messages"], seed_run["state"]
    assert [(m.type, m.content) for m in initial] == [(MessageType.SYSTEM, "Solve this math problem:"),
                                                      (MessageType.MESSAGE, "What is 2 + 3?")]
    assert state == {"answer": "5"}
    # the last rollout: the quick start's, then the tool and multi-agent turns appended to it
    assert [m.type for m in seed_run["rollout"]][3:] == [MessageType.MODEL, MessageType.SYSTEM, MessageType.MODEL,
                                                         MessageType.MODEL, MessageType.MODEL, MessageType.MODEL,
                                                         MessageType.SYSTEM, MessageType.MODEL]


def test_the_seed_router_r1_package_imports():
    """"The `SimpleTorchLLMRL.router_r1` package bundles the components required to reproduce the
    Router-R1 ... recipe": the name is the recipe's package, its modules the recipe's modules."""
    seed = importlib.import_module("SimpleTorchLLMRL.router_r1")
    recipe = importlib.import_module("SimpleTorchLLMRL.recipes.router_r1")
    assert seed is recipe
    for name in ("config", "data", "generation", "pool", "reward", "tags", "trainer"):  # the seed package's modules
        assert importlib.import_module(f"SimpleTorchLLMRL.router_r1.{name}") is getattr(recipe, name)
    from SimpleTorchLLMRL.router_r1 import RouterR1Trainer, RouterReward, RouterTrainingConfig
    from SimpleTorchLLMRL.router_r1.config import RouterDataConfig

    assert RouterR1Trainer.__module__ == "SimpleTorchLLMRL.recipes.router_r1.trainer"
    assert RouterReward is recipe.RouterReward and RouterTrainingConfig is recipe.RouterTrainingConfig
    assert RouterDataConfig is recipe.RouterDataConfig


def test_the_router_r1_examples_the_seed_names_exist():
    root = Path(__file__).resolve().parents[2]
    assert (root / "examples" / "router_r1_training.py").is_file()
    assert (root / "examples" / "router_r1_math_qwen.py").is_file()


# ----------------------------------------------------------------------------- one table, one mechanism

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "SimpleTorchLLMRL"


def test_every_seed_path_gives_its_real_module():
    """Each row of the table: the seed path and the module it names now are one object. Before a row's rename
    lands (the real module not there yet), the seed path is still its own file, and that file wins."""
    from SimpleTorchLLMRL.seed import SEED_MODULES

    for seed, real in SEED_MODULES.items():
        seed_file = PACKAGE.parent / (seed.replace(".", "/") + ".py")
        if importlib.util.find_spec(real) is None:
            assert seed_file.is_file(), f"{seed}: neither {real} nor the seed's own file exists"
            assert importlib.import_module(seed).__name__ == seed
        else:
            assert not seed_file.is_file() and not seed_file.with_suffix("").is_dir(), seed
            assert importlib.import_module(seed) is importlib.import_module(real), seed


def test_monkeypatching_through_a_seed_path_patches_the_real_module(monkeypatch):
    import SimpleTorchLLMRL.env.QASolve as seed_path

    from SimpleTorchLLMRL.env import QASolverEnv, qa_solver

    monkeypatch.setattr(seed_path, "DEFAULT_QA_PROMPT", "patched")
    assert qa_solver.DEFAULT_QA_PROMPT == "patched"
    assert [m.content for m in QASolverEnv().setup("q")[0]] == ["patched", "q"]


def test_each_seed_path_resolves_in_a_fresh_interpreter(tmp_path):
    """No file has a seed path's name (trainer/GRPO.py is trainer/grpo.py, model/generate.py is
    model/generation/generator.py): a fresh interpreter imports each seed path as the renamed module itself."""
    for old in ("trainer/GRPO.py", "model/generate.py", "env/QASolve.py", "env/ToolQASolve.py", "router_r1"):
        assert not (PACKAGE / old).exists(), old
    copy = tmp_path / "SimpleTorchLLMRL"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    code = """
import importlib, sys, warnings
warnings.simplefilter("error")
from SimpleTorchLLMRL.seed import SEED_MODULES
for seed, real in SEED_MODULES.items():
    assert importlib.import_module(seed) is importlib.import_module(real), seed
from SimpleTorchLLMRL.trainer.GRPO import GRPO
from SimpleTorchLLMRL.model.generate import ModelGenerate
import SimpleTorchLLMRL
assert GRPO is SimpleTorchLLMRL.GRPO and ModelGenerate is SimpleTorchLLMRL.ModelGenerate
assert sys.modules["SimpleTorchLLMRL.trainer.GRPO"].__file__.endswith("trainer/grpo.py")
print("ok", SimpleTorchLLMRL.__file__)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok", str(copy / "__init__.py")]


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A package `toyseed` with modules `new` and `newpkg.child`, on sys.path; forgotten afterwards."""
    root = tmp_path / "toyseed"
    (root / "newpkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "new.py").write_text("VALUE = 1\n")
    (root / "newpkg" / "__init__.py").write_text("from toyseed.newpkg import child\n")
    (root / "newpkg" / "child.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "toyseed" or m.startswith("toyseed.")]:
        del sys.modules[name]


def test_the_finder_gives_the_same_module_object_and_a_real_module_wins(toy_package, monkeypatch):
    from SimpleTorchLLMRL.seed import SeedPaths

    finder = SeedPaths({"toyseed.old": "toyseed.new", "toyseed.real": "toyseed.new",
                        "toyseed.oldpkg": "toyseed.newpkg", "toyseed.oldpkg.child": "toyseed.newpkg.child"})
    (toy_package / "real.py").write_text("VALUE = 3\n")  # a real module of a seed path's name
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])

    import toyseed.new
    import toyseed.old
    from toyseed import old as by_from

    assert toyseed.old is toyseed.new is by_from
    monkeypatch.setattr(toyseed.old, "VALUE", 10)
    assert toyseed.new.VALUE == 10
    assert importlib.import_module("toyseed.real").VALUE == 3  # the path finders come first
    child = importlib.import_module("toyseed.oldpkg.child")  # never a second copy through the package's path
    assert child is importlib.import_module("toyseed.newpkg.child") and child.__name__ == "toyseed.newpkg.child"
    assert importlib.import_module("toyseed.oldpkg") is importlib.import_module("toyseed.newpkg")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("toyseed.nothing")


def test_the_seed_finder_is_installed_once_and_last():
    """After the path finders: a real module of a seed path's name always wins."""
    from importlib.machinery import PathFinder

    from SimpleTorchLLMRL import seed

    seed.install()
    assert sys.meta_path.count(seed.FINDER) == 1
    assert sys.meta_path.index(seed.FINDER) > sys.meta_path.index(PathFinder)


def _module_getattrs(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body) or any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in n.targets)
        for n in tree.body)


def _import_state_writes(tree: ast.Module) -> list[int]:
    """Lines that write `sys.modules[...]`, or change `sys.meta_path` / `sys.path_hooks` / `sys.modules` by a call."""
    lines = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
                lines.append(n.lineno)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and ast.unparse(n.func.value) in (
                "sys.modules", "sys.meta_path", "sys.path_hooks") and n.func.attr not in ("get", "index", "count"):
            lines.append(n.lineno)
    return lines


# Writes to sys.modules that are not aliases: the sandbox launcher loads its sibling files under their own names.
OWN_LOADERS = {"tools/sandbox_launch.py"}


def alias_mechanisms(package_dir: Path = PACKAGE) -> dict[str, list[str]]:
    """file -> what in it could serve an old name: a module `__getattr__` (the front door's aside), a write to the
    import system's state, a DeprecationWarning. seed.py is the one place allowed to."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).as_posix()
        if rel == "seed.py":
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        what = []
        if _module_getattrs(tree) and rel != "__init__.py":
            what.append("a module __getattr__")
        if rel not in OWN_LOADERS:
            what += [f"line {n}: writes the import system's state" for n in _import_state_writes(tree)]
        if "DeprecationWarning" in source:
            what.append("a DeprecationWarning")
        if what:
            found[rel] = what
    return found


def test_the_seed_table_is_the_only_alias_mechanism():
    assert alias_mechanisms() == {}


def test_the_front_door_serves_its_names_and_the_seeds_only():
    import SimpleTorchLLMRL
    from SimpleTorchLLMRL.seed import SEED_NAMES

    assert sorted(SimpleTorchLLMRL._WHERE) == SimpleTorchLLMRL.__all__
    assert not set(SEED_NAMES) & set(SimpleTorchLLMRL.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Batch'"):
        SimpleTorchLLMRL.Batch  # noqa: B018  (0.1.0 served it with a warning)


def test_the_alias_check_names_each_mechanism(tmp_path):
    copy = tmp_path / "SimpleTorchLLMRL"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    with (copy / "env" / "base.py").open("a") as f:
        f.write("\n\ndef __getattr__(name):\n    raise AttributeError(name)\n")
    with (copy / "reward" / "text.py").open("a") as f:
        f.write("\nimport sys\nsys.modules['SimpleTorchLLMRL.reward.old'] = sys.modules[__name__]\n")
    with (copy / "tools" / "base.py").open("a") as f:
        f.write("\nimport sys\nsys.meta_path.append(object())\n")
    found = alias_mechanisms(copy)
    assert found["env/base.py"] == ["a module __getattr__"]
    assert [w.split(": ")[1] for w in found["reward/text.py"]] == ["writes the import system's state"]
    assert [w.split(": ")[1] for w in found["tools/base.py"]] == ["writes the import system's state"]
