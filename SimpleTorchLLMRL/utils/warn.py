"""Warnings that point at the user's line, not at the library's.

`warn_user(message)` attributes the warning to the first frame outside this package
(what `warnings.warn(..., skip_file_prefixes=...)` does on Python 3.12+), so
`python -W error` and the printed location both name the caller's code.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent.parent)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    frame, level = sys._getframe(1), 2  # level 2: the caller of warn_user
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
