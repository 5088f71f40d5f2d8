"""Old import paths of moved modules, kept working for one release: one table, one finder, one warning.

A package whose modules moved keeps one table in its `__init__.py` and hands it to `alias_moved`:

    MOVED = {"pkg.old": "pkg.sub.new",                 # a module that moved
             "pkg.old:name": "pkg.sub.other"}          # a name that left the module when it was split
    __getattr__ = alias_moved(__name__, MOVED)

Then `import pkg.old`, `from pkg.old import x` and `from pkg import old` all give the NEW module
itself, the same object (so `monkeypatch.setattr(old, "X", ...)` patches the real module), with
one `DeprecationWarning` per old name and process (`warn.warn_deprecated`, pointing at the
importing line). `pkg.old:name` rows keep `from pkg.old import name` working for a name that
now lives in another module (also with the warning). Nothing is imported before it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Mapping

from SimpleTorchLLMRL.utils.warn import warn_deprecated


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder that answers only for the old module names of its table."""

    def __init__(self) -> None:
        self.modules: dict[str, str] = {}  # old module -> new module
        self.names: dict[str, dict[str, str]] = {}  # old module -> {name that left: its new module}

    def add(self, table: Mapping[str, str]) -> None:
        for old, new in table.items():
            module, _, name = old.partition(":")
            if name:
                self.names.setdefault(module, {})[name] = new
            else:
                self.modules[old] = new
        unknown = sorted(set(self.names) - set(self.modules))
        if unknown:
            raise ValueError(f"moved names of modules that are not in the table: {unknown}")

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        old = module.__name__
        new = self.modules[old]
        real = importlib.import_module(new)
        warn_deprecated(old, new)
        if old in self.names:
            _resolve_names_that_left(real, old, self.names[old])
        sys.modules[old] = real  # the import system returns (and binds) what sys.modules holds


def _resolve_names_that_left(real, old: str, names: dict[str, str]) -> None:
    """Give the real module a module `__getattr__` (PEP 562) for the names that left it (unless it has one)."""
    if "__getattr__" in vars(real):
        return

    def __getattr__(name: str):
        home = names.get(name)
        if home is None:
            raise AttributeError(f"module {real.__name__!r} has no attribute {name!r}")
        warn_deprecated(f"{old}.{name}", f"{home}.{name}")
        return getattr(importlib.import_module(home), name)

    real.__getattr__ = __getattr__


FINDER = MovedModules()


def alias_moved(package: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """Serve `table`'s old module names from their new modules; returns the package's module `__getattr__`
    (for `from package import old`). Each old name must be a direct child of `package`."""
    strays = sorted(old for old in table if old.partition(":")[0].rpartition(".")[0] != package)
    if strays:
        raise ValueError(f"{package}: moved modules must be its direct children, got {strays}")
    FINDER.add(table)
    if FINDER not in sys.meta_path:
        sys.meta_path.append(FINDER)  # after the path finders: a real module of that name always wins

    def __getattr__(name: str):
        old = f"{package}.{name}"
        if old not in FINDER.modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        __import__(old)  # not importlib.import_module: its frame would be the one the warning names
        return sys.modules[old]

    return __getattr__
