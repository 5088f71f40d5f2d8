"""The seed's module name for `QASolverEnv` (a seed path, silent): the env lives in `env/qa_solver.py`.

Import it as `from SimpleTorchLLMRL.env import QASolverEnv`; this module's other old name,
`DEFAULT_QA_PROMPT`, resolves with a DeprecationWarning (CHANGELOG.md).
"""

from __future__ import annotations

import importlib

from SimpleTorchLLMRL.env.qa_solver import QASolverEnv
from SimpleTorchLLMRL.utils.warn import warn_deprecated

__all__ = ["QASolverEnv"]
_HOME = "SimpleTorchLLMRL.env.qa_solver"


def __getattr__(name: str):
    if name != "DEFAULT_QA_PROMPT":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_deprecated(f"{__name__}.{name}", f"{_HOME}.{name}")
    return getattr(importlib.import_module(_HOME), name)
