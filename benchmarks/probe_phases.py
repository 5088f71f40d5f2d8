"""A `--patch` probe for grpo_vs_trl.py (our side): per call, CPU and system seconds, minor page faults and RSS;
for the loss forward, the bytes autograd saves for backward (parameters excluded). Prints PROBE lines to stderr.

    UV_PROJECT_ENVIRONMENT=/tmp/benchvenv uv run --group bench python benchmarks/grpo_vs_trl.py \
        --child ours --shape qwen2.5-0.5b --patch benchmarks/probe_phases.py
"""

import functools
import resource
import sys
import time

import psutil
import torch

from SimpleTorchLLMRL.model.generation.generator import ModelGenerate
from SimpleTorchLLMRL.model.scoring import logprobs as _lp
from SimpleTorchLLMRL.trainer.grpo import GRPO

_proc = psutil.Process()


def _wrap(owner, name: str, label: str, saved: bool = False) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def probed(*a, **k):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        params = {p.untyped_storage().data_ptr() for p in a[0].model.parameters()} if saved else set()
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen and key[0] not in params:
                seen.add(key)
                total[0] += key[1]
            return t

        try:
            if saved:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return fn(*a, **k)
            return fn(*a, **k)
        finally:
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            extra = f", autograd saved {total[0] / 2**20:.0f} MiB" if saved else ""
            print(f"PROBE {label}: cpu {time.process_time() - t0:.2f} s, sys {r1.ru_stime - r0.ru_stime:.2f} s, "
                  f"minflt {r1.ru_minflt - r0.ru_minflt}, rss {_proc.memory_info().rss / 2**20:.0f} MiB, "
                  f"maxrss {r1.ru_maxrss // 1024} MiB{extra}", file=sys.stderr, flush=True)

    setattr(owner, name, probed)


_wrap(ModelGenerate, "generate", "generate")
_wrap(GRPO, "calculate_loss", "loss_forward", saved=True)
_wrap(_lp._FusedTokenLoss, "apply", "fused_head")
_wrap(torch.Tensor, "backward", "backward")
_wrap(torch.optim.AdamW, "step", "adamw_step")
