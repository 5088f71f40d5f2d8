"""Warnings that point at the user's line, not at the library's.

`warn_user(message)` attributes the warning to the first frame outside this package
(what `warnings.warn(..., skip_file_prefixes=...)` does on Python 3.12+), so
`python -W error` and the printed location both name the caller's code. The import system's
own frames are skipped as `warnings` skips them, so a warning raised while a module is imported
names the importing line.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent.parent)


def _outside_package(filename: str) -> bool:
    return not filename.startswith(_PACKAGE)


def _import_machinery(filename: str) -> bool:
    """A frame of importlib's bootstrap, which `warnings.warn` neither counts in `stacklevel` nor names."""
    return "importlib" in filename and "_bootstrap" in filename


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    frame, level = sys._getframe(1), 2  # level 2: the caller of warn_user
    while frame is not None and not (_outside_package(frame.f_code.co_filename)
                                     and not _import_machinery(frame.f_code.co_filename)):
        frame = frame.f_back
        if frame is not None and not _import_machinery(frame.f_code.co_filename):
            level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)


DEPRECATED_SEEN: set[str] = set()  # the deprecated spellings already reported in this process


def warn_deprecated(old: str, new: str) -> None:
    """The one deprecation style: a `DeprecationWarning` "<old> is deprecated; use <new>", once per process
    per spelling, pointing at the user's line."""
    if old not in DEPRECATED_SEEN:
        DEPRECATED_SEEN.add(old)
        warn_user(f"{old} is deprecated; use {new}", DeprecationWarning)
