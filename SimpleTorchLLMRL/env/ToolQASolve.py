"""The seed's module name for `ToolUseEnv` (a seed path, silent): the env lives in `env/tool_use.py`.

Import it as `from SimpleTorchLLMRL.env import ToolUseEnv`; this module's other old names
(`ToolEpisode`, `tool_stats`, `default_tool_prompt`) resolve with a DeprecationWarning (CHANGELOG.md).
"""

from __future__ import annotations

import importlib

from SimpleTorchLLMRL.env.tool_use import ToolUseEnv
from SimpleTorchLLMRL.utils.warn import warn_deprecated

__all__ = ["ToolUseEnv"]
_HOME = "SimpleTorchLLMRL.env.tool_use"
_LEFT = ("ToolEpisode", "tool_stats", "default_tool_prompt")


def __getattr__(name: str):
    if name not in _LEFT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_deprecated(f"{__name__}.{name}", f"{_HOME}.{name}")
    return getattr(importlib.import_module(_HOME), name)
