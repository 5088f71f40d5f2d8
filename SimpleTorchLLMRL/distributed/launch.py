"""Process-group setup from the environment `torchrun` exports (world size 1 without it, no group created).

    info = init_distributed()                       # gloo on CPU, nccl on CUDA
    my_rows = shard_indices(len(batch), info.rank, info.world_size)
    cleanup()
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend(device: str | torch.device | None = None) -> str:
    """nccl when the process computes on CUDA, gloo otherwise."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "nccl" if cuda else "gloo"


def init_distributed(backend: str | None = None, device: str | None = None,
                     timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun describes (idempotent); world size 1 without torchrun.

    backend: "gloo" or "nccl"; None picks nccl on CUDA and gloo on CPU.
    device: "cpu" or "cuda"; None picks cuda:LOCAL_RANK when CUDA is available.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if device is not None and torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or None, got {device!r}")
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    backend = backend or default_backend(dev)
    if backend == "nccl" and not use_cuda:
        raise ValueError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
    if launched_by_torchrun() and not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if use_cuda and backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
    return DistInfo(rank=get_rank(), world_size=get_world_size(), local_rank=local, device=dev)


def get_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if get_world_size() > 1:
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_indices(n: int, rank: int | None = None, world_size: int | None = None) -> range:
    """Rows [start, stop) of a global batch of `n` that `rank` owns (contiguous, sizes differ by at most 1).

    Keep GRPO groups whole by sharding group indices rather than rollouts.
    """
    rank = get_rank() if rank is None else rank
    world_size = get_world_size() if world_size is None else world_size
    if n < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_indices needs n >= 0 and 0 <= rank < world_size, got n={n}, rank={rank}, "
                         f"world_size={world_size}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def data_parallel_normalizer(local_normalizer: float) -> float:
    """The loss normalizer each rank passes so that averaged gradients equal one process on the global batch.

    FSDP2 / DDP average gradients over ranks, so a rank divides its share of
    the loss by (global normalizer / world_size), where the global normalizer
    is the sum of the ranks' local ones (sequences or trained tokens):

        norm = data_parallel_normalizer(grpo.normalizer_for(my_rollouts))
        loss = grpo.calculate_loss(my_rollouts, my_rewards, normalizer=norm)
    """
    return float(all_reduce_sum(float(local_normalizer))) / get_world_size()


def all_reduce_sum(value: torch.Tensor | float) -> torch.Tensor:
    """Sum a scalar or tensor over ranks (a copy; identity at world size 1)."""
    t = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    if get_world_size() > 1:
        home = t.device
        if dist.get_backend() == "nccl" and home.type != "cuda":
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t.to(home)
    return t
