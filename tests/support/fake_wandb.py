"""A stand-in for the wandb module (never the network): records each init and what each run logs."""

from __future__ import annotations

import importlib.machinery
import types


class FakeWandb:
    __spec__ = importlib.machinery.ModuleSpec("wandb", None)  # importlib.util.find_spec("wandb") asks for it

    def __init__(self):
        self.inits: list[dict] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run = types.SimpleNamespace(id=kwargs.get("id") or f"run{len(self.inits)}", logged=[])
        run.log = lambda row, step: run.logged.append((step, row))
        run.finish = lambda: None
        return run
