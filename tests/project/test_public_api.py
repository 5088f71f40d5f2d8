"""The public import paths are part of the contract (docs/architecture.md): they must keep working."""

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import SimpleTorchLLMRL

SEED_PATHS = [  # (the seed's module, a name it showed): each is the object of the name's one documented path
    ("SimpleTorchLLMRL.chat.message", "Rollout"),
    ("SimpleTorchLLMRL.chat.message", "Message"),
    ("SimpleTorchLLMRL.chat.message", "MessageType"),
    ("SimpleTorchLLMRL.model.generate", "ModelGenerate"),
    ("SimpleTorchLLMRL.trainer.GRPO", "GRPO"),
    ("SimpleTorchLLMRL.reward.boxed", "BoxedReward"),
    ("SimpleTorchLLMRL.env.QASolve", "QASolverEnv"),
    ("SimpleTorchLLMRL.env.ToolQASolve", "ToolUseEnv"),
]


@pytest.mark.parametrize("module,name", SEED_PATHS)
def test_seed_import_paths(module, name):
    """The seed's path names the object of the one documented path (the front door, or the package)."""
    one_path = SimpleTorchLLMRL if name in SimpleTorchLLMRL.__all__ else importlib.import_module(module.rpartition(".")[0])
    assert getattr(importlib.import_module(module), name) is getattr(one_path, name)


@pytest.mark.parametrize("name", SimpleTorchLLMRL.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(SimpleTorchLLMRL, name) is not None


def test_the_seed_router_names_resolve_silently_from_the_recipe():
    """The seed exported the Router-R1 configs, manager, reward and trainer from the package (outside `__all__`)."""
    from SimpleTorchLLMRL.seed import SEED_NAMES

    recipe = importlib.import_module("SimpleTorchLLMRL.recipes.router_r1")
    assert len(SEED_NAMES) == 10
    for name in SEED_NAMES:
        SimpleTorchLLMRL.__dict__.pop(name, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert getattr(SimpleTorchLLMRL, name) is getattr(recipe, name)
        assert name not in SimpleTorchLLMRL.__all__


@pytest.mark.parametrize("name", ["Batch", "collate", "save_rollouts", "token_logprobs", "logprob_drift",
                                  "QASolverEnv", "ToolUseEnv", "Tool", "CombinedReward", "MetricsLogger",
                                  "RouterEnv", "RoutingPool"])
def test_names_earlier_releases_exported_here_are_gone(name):
    """0.2.0 serves no old spelling but the seed's: these are imported from their one path (CHANGELOG.md)."""
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(SimpleTorchLLMRL, name)


def test_the_version_is_the_projects():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert SimpleTorchLLMRL.__version__ == pyproject["project"]["version"] == "0.2.0"
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    assert "\n## 0.2.0" in changelog and "\n## 0.1.0 (2026-11-28)" in changelog


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
