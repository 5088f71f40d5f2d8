"""A small verifiers taskset for the tests: add two numbers, answer in \\boxed{}.

Its id is this module's name (`tiny_sum`); a task whose `fail` is set raises in its reward, so its trace
fails (what `collect` must drop and count, never score 0).
"""

import verifiers.v1 as vf

from SimpleTorchLLMRL.recipes.calculator.arithmetic import SYSTEM_PROMPT

PROBLEMS = [(14, 25), (30, 12), (7, 8), (52, 41)]


class SumData(vf.TaskData):
    answer: str
    fail: bool = False


class SumTask(vf.Task[SumData, vf.State]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        if task.fail:
            raise RuntimeError("the grader crashed")
        return float(vf.extract_boxed_answer(trace.last_reply, strict=True).strip() == task.answer)

    @vf.reward(weight=0.5)
    async def boxed(self, trace: vf.Trace) -> float:
        return float("\\boxed{" in trace.last_reply)


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in PROBLEMS:
            yield SumTask(SumData(prompt=f"What is {a} + {b}?", answer=str(a + b), system_prompt=SYSTEM_PROMPT),
                          self.config.task)


__all__ = ["SumTaskset"]
