"""The public import paths are part of the contract (docs/architecture.md): they must keep working."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import SimpleTorchLLMRL

SEED_PATHS = [
    ("SimpleTorchLLMRL.chat.message", "Rollout"),
    ("SimpleTorchLLMRL.chat.message", "Message"),
    ("SimpleTorchLLMRL.chat.message", "MessageType"),
    ("SimpleTorchLLMRL.model.generate", "ModelGenerate"),
    ("SimpleTorchLLMRL.trainer.GRPO", "GRPO"),
    ("SimpleTorchLLMRL.reward.boxed", "BoxedReward"),
    ("SimpleTorchLLMRL.env.QASolve", "QASolverEnv"),
    ("SimpleTorchLLMRL.env.ToolQASolve", "ToolUseEnv"),
]

ROUTER_NAMES = ["RouterDataConfig", "RouterGenerationConfig", "RouterToolConfig", "RouterRewardConfig",
                "RouterTrainerConfig", "RouterValidationConfig", "RouterTrainingConfig"]


@pytest.mark.parametrize("module,name", SEED_PATHS)
def test_seed_import_paths(module, name):
    """The seed's path names the object of the one documented path (the front door, or the package)."""
    one_path = SimpleTorchLLMRL if name in SimpleTorchLLMRL.__all__ else importlib.import_module(module.rpartition(".")[0])
    assert getattr(importlib.import_module(module), name) is getattr(one_path, name)


@pytest.mark.parametrize("name", SimpleTorchLLMRL.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(SimpleTorchLLMRL, name) is not None


def test_router_r1_names_exported_from_the_package():
    """Earlier users imported the Router-R1 configs from the package: they still resolve (outside `__all__`)."""
    for name in ROUTER_NAMES:
        assert getattr(SimpleTorchLLMRL, name).__module__.startswith("SimpleTorchLLMRL.recipes.router_r1")


EARLIER_NAMES = ["Batch", "EncodedRollout", "collate", "encode_prompt", "encode_rollouts", "as_sampled",
                 "save_rollouts", "load_rollouts", "RolloutWriter", "token_logprobs", "logprob_drift",
                 "QASolverEnv", "ToolUseEnv", "Tool", "CombinedReward", "MetricsLogger",
                 "RouterEnv", "RoutingPool", "CallableModel", "HFModel", "OpenAIModel"]


@pytest.mark.parametrize("name", EARLIER_NAMES)
def test_names_exported_by_an_earlier_release_still_resolve_with_a_warning(name):
    """Each resolves to its one path's object, with a DeprecationWarning at the caller's line naming that path."""
    SimpleTorchLLMRL.__dict__.pop(name, None)  # a name resolves (and warns) once per process
    with pytest.warns(DeprecationWarning, match=rf"SimpleTorchLLMRL\.{name} is deprecated; use `from (\S+) import {name}`") as w:
        value = getattr(SimpleTorchLLMRL, name)
    module = re.search(r"use `from (\S+) import", str(w[0].message)).group(1)
    assert value is getattr(importlib.import_module(module), name)
    assert w[0].filename == __file__  # points at the line that used the old name


def test_the_seed_router_names_resolve_silently():
    import warnings

    for name in ROUTER_NAMES + ["RouterGenerationManager", "RouterReward", "RouterR1Trainer"]:
        SimpleTorchLLMRL.__dict__.pop(name, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(SimpleTorchLLMRL, name) is getattr(importlib.import_module("SimpleTorchLLMRL.router_r1"), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        SimpleTorchLLMRL.Nope  # noqa: B018


def test_package_import_is_light():
    """Importing the package loads neither torch nor transformers (names load on first use)."""
    code = "import sys, SimpleTorchLLMRL; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ----------------------------------------------------------------------------- stated return types

_OWN = re.compile(r"^\s*(?:Returns?|Gives)\s+(?:an?\s+|the\s+)?`([A-Z]\w*)", re.M)  # "Returns `X`..." of itself
_NAMED = re.compile(r"`(?:\w+\.)?(\w+)(?:\([^`]*\))?`\s+returns\s+(?:an?\s+|the\s+|its\s+)?`([A-Z]\w*)")
_COMMENT = re.compile(r"\.(\w+)\([^)\n]*\)\s+#\s*(?:->\s*)?([A-Z]\w*)\(")  # `out = grpo.compute(mb)  # X(...)`


def stated_return_mismatches(source: str) -> list[tuple[str, str, str]]:
    """(function, the type a docstring says it returns, its annotation) wherever the two disagree.

    A docstring states a return type as "Returns `X`" (its own), "`f` returns a `X`", or in a quoted
    call `y = obj.f(...)  # X(...)`; each claim is held to the annotations of the functions of that name
    in the same file (only types written in CamelCase are claims; argument names are not)."""
    tree = ast.parse(source)
    annotated = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            annotated.setdefault(n.name, []).append(n.returns)
    out = []
    for n in ast.walk(tree):
        if not isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(n) or ""
        claims = [(f, t) for pattern in (_NAMED, _COMMENT) for f, t in pattern.findall(doc)]
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            claims += [(n.name, t) for t in _OWN.findall(doc)[:1]]
        for name, stated in claims:
            for returns in annotated.get(name, []):
                words = {x.id for x in ast.walk(returns) if isinstance(x, ast.Name)}
                words |= {x.attr for x in ast.walk(returns) if isinstance(x, ast.Attribute)}
                if stated not in words:
                    out.append((name, stated, ast.unparse(returns)))
    return sorted(set(out))


def test_each_stated_return_type_is_the_annotated_one():
    package = Path(SimpleTorchLLMRL.__file__).parent
    found = {p.relative_to(package).as_posix(): stated_return_mismatches(p.read_text())
             for p in sorted(package.rglob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_return_type_check_catches_each_form():
    source = '''
class Front:
    """`compute` returns a `LossOutput`; `loss(...)` returns the `Tensor`."""

    def compute(self) -> StepOutput:
        """Returns `LossOutput(loss, metrics)`."""

    def loss(self) -> torch.Tensor: ...


def step():
    """    out = front.compute(batch)   # LossOutput(loss, metrics)
    Returns `model` unchanged (an argument name, not a type: no claim)."""
'''
    assert stated_return_mismatches(source) == [("compute", "LossOutput", "StepOutput")]
    assert stated_return_mismatches(source.replace("-> StepOutput", "-> LossOutput")) == []


def test_the_changelog_lists_every_old_name():
    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    old = [n for table in (SimpleTorchLLMRL._EARLIER, SimpleTorchLLMRL._SEED) for names in table.values() for n in names]
    old += ["Sample", "cut_sample"]  # the names model/generate.py served until 0.2.0
    assert len(old) == 33
    assert [n for n in old if f"`{n}`" not in changelog and f".{n}`" not in changelog] == []
