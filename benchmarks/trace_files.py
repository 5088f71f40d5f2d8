"""How many library files one call passes through: `sys.settrace` over `SimpleTorchLLMRL/`.

    uv run python benchmarks/trace_files.py                 # every scenario
    uv run python benchmarks/trace_files.py grpo main_step  # some of them

Each scenario runs twice on the embedded tiny model; the second run is traced (the first pays for imports
and caches). "files" counts the distinct library files whose code ran; "switches" counts the calls from one
library file into another (how often a reader jumps between files).

Scenarios:
  grpo       `GRPO.calculate_loss(rollouts, rewards).backward()` on 8 sampled rollouts
  main_step  one `main.py` step: the step's rollouts, their rewards, `train_step`
  chat       one plain (non-streamed) chat request through the gateway, in process (`TestClient`)
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = str(ROOT / "SimpleTorchLLMRL") + "/"


class FileTrace:
    """The library files a traced block ran, and the switches between them (every thread)."""

    def __init__(self):
        self.files: list[str] = []
        self.switches = 0
        self.active = False

    def _tracer(self, frame, event, arg):
        if not self.active:
            return self._tracer if event == "call" else None
        path = frame.f_code.co_filename
        if event in ("call", "return") and path.startswith(LIBRARY):
            name = path[len(LIBRARY):]
            if name not in self.files:
                self.files.append(name)
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            if event == "call" and caller.startswith(LIBRARY) and caller[len(LIBRARY):] != name:
                self.switches += 1
        return self._tracer if event == "call" else None

    def install(self) -> FileTrace:
        """Trace this thread and every thread started from now on (servers start theirs early)."""
        threading.settrace(self._tracer)
        sys.settrace(self._tracer)
        return self

    def uninstall(self) -> None:
        sys.settrace(None)
        threading.settrace(None)


TRACE = FileTrace()


def traced(fn) -> FileTrace:
    fn()  # warm: imports, caches, compiled templates
    TRACE.install()
    TRACE.active = True
    try:
        fn()
    finally:
        TRACE.active = False
        TRACE.uninstall()
    return TRACE


def _calc():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from SimpleTorchLLMRL.testing.tiny import TINY_CALC

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(TINY_CALC), AutoTokenizer.from_pretrained(TINY_CALC)


def scenario_grpo():
    import torch

    from SimpleTorchLLMRL import GRPO, BoxedReward, ModelGenerate, collect_rollouts
    from SimpleTorchLLMRL.env import ToolUseEnv
    from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT, build_dataset
    from SimpleTorchLLMRL.tools import calculator

    model, tok = _calc()
    rows = build_dataset(2, seed=0)
    env = ToolUseEnv([calculator], custom_sys_prompt=SYSTEM_PROMPT, max_turns=2)
    gen = ModelGenerate(model, tok, max_new_tokens=24, temperature=1.0, tool_call_stop=env.stop_strings, seed=0)
    rollouts = collect_rollouts(gen, env, [r["question"] for r in rows], [r["answer"] for r in rows], group_size=4)
    rewards = BoxedReward()(rollouts, [r.metadata["answer"] for r in rollouts])
    rewards = rewards + torch.arange(len(rollouts)) * 0.01  # never a constant group
    grpo = GRPO(model, tok)

    def step():
        grpo.calculate_loss(rollouts, rewards).backward()

    return traced(step)


def scenario_main_step():
    import tempfile

    import main as main_py

    out = tempfile.mkdtemp(prefix="trace_main_")
    lock = main_py.RunLock()
    run = main_py.load(["--output-dir", out, "--batch-size", "2", "--group-size", "4", "--steps", "2"], lock)
    main_py.build(run)
    main_py.resume(run)
    counter = iter(range(1, 100))

    def step():
        n = next(counter)
        rollouts = main_py.rollouts_for(run, n, n - 1)
        rewards = run.reward_fn(rollouts, [r.metadata["answer"] for r in rollouts])
        main_py.train_step(run, n, rollouts, rewards)

    try:
        return traced(step)
    finally:
        run.logger.close()
        lock.release()


def scenario_chat():
    from fastapi.testclient import TestClient

    TRACE.install()  # before the gateway's and the test client's threads start

    from SimpleTorchLLMRL import ModelGenerate
    from SimpleTorchLLMRL.gateway import Gateway

    model, tok = _calc()
    tok.padding_side = "left"
    gw = Gateway(ModelGenerate(model.eval(), tok, max_new_tokens=16, temperature=1.0, seed=0))
    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 645 * 49?"}], "max_tokens": 16}
    with TestClient(gw.app()) as client:
        def call():
            r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer trace"})
            assert r.status_code == 200, r.text

        return traced(call)


SCENARIOS = {"grpo": scenario_grpo, "main_step": scenario_main_step, "chat": scenario_chat}


def main(names: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    global TRACE
    for name in names or list(SCENARIOS):
        TRACE = FileTrace()
        t = SCENARIOS[name]()
        print(f"{name}: {len(t.files)} library files, {t.switches} switches")
        for f in t.files:
            print(f"    {f}")


if __name__ == "__main__":
    main(sys.argv[1:])
