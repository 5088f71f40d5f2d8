"""Import an optional environment library, or fail naming the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """`importlib.import_module(module)`; ImportError naming `uv sync --extra EXTRA` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name.split(".")[0]):
            raise  # the library is there but one of its own imports failed: show that
        raise ImportError(f"{module} is not installed: this integration needs the {extra!r} extra "
                          f"(`uv sync --extra {extra}` or `pip install 'SimpleTorchLLMRL[{extra}]'`)") from e
