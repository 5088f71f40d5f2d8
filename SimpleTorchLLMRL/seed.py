"""The seed's import paths: one table, one finder. They are part of the contract, so they stay, silently.

    from SimpleTorchLLMRL.trainer.GRPO import GRPO          # SimpleTorchLLMRL.trainer.grpo
    from SimpleTorchLLMRL.env.QASolve import QASolverEnv    # SimpleTorchLLMRL.env.qa_solver
    import SimpleTorchLLMRL.router_r1                       # SimpleTorchLLMRL.recipes.router_r1
    from SimpleTorchLLMRL import RouterR1Trainer            # SEED_NAMES (the root's __getattr__ reads it)

Each gives the module it names now, the same object. `FINDER` sits on `sys.meta_path` after the path
finders (a real module of that name wins), answers for `SEED_MODULES` only, and imports nothing unasked.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_R1 = "SimpleTorchLLMRL.recipes.router_r1"
_R1_MODULES = ("config", "data", "generation", "pool", "reward", "tags", "trainer")

SEED_MODULES = {  # the seed's module path -> the module it names now
    "SimpleTorchLLMRL.trainer.GRPO": "SimpleTorchLLMRL.trainer.grpo",
    "SimpleTorchLLMRL.model.generate": "SimpleTorchLLMRL.model.generation.generator",
    "SimpleTorchLLMRL.env.QASolve": "SimpleTorchLLMRL.env.qa_solver",
    "SimpleTorchLLMRL.env.ToolQASolve": "SimpleTorchLLMRL.env.tool_use",
    "SimpleTorchLLMRL.router_r1": _R1,
    **{f"SimpleTorchLLMRL.router_r1.{name}": f"{_R1}.{name}" for name in _R1_MODULES},
}

SEED_NAMES = dict.fromkeys(  # the names the seed exported from `SimpleTorchLLMRL` itself -> their module
    ["RouterDataConfig", "RouterGenerationConfig", "RouterToolConfig", "RouterRewardConfig", "RouterTrainerConfig",
     "RouterValidationConfig", "RouterTrainingConfig", "RouterGenerationManager", "RouterReward", "RouterR1Trainer"],
    _R1,
)


class SeedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that answers only for the seed paths of its table: each gives its real module."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = dict(table)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.table:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        seed = module.__name__
        sys.modules[seed] = importlib.import_module(self.table[seed])  # the import system returns what it holds
        # A package's path is the real package's: its modules must be these entries before the path
        # finders (which come first) could load a second copy of one under the seed's name.
        for child, real in self.table.items():
            if child.rpartition(".")[0] == seed:
                sys.modules[child] = importlib.import_module(real)


FINDER = SeedPaths(SEED_MODULES)


def install() -> None:
    """Put `FINDER` on `sys.meta_path`, after the path finders (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.append(FINDER)
