"""Multi-process training on torch.distributed: process groups, FSDP2, DeepSpeed (optional extra).

    launch.py     init_distributed (torchrun env; gloo on CPU, nccl on CUDA), shard_indices,
                  data_parallel_normalizer, all_reduce_sum
    fsdp.py       wrap_fsdp2, sharded_parameters, full_state_dict, allocate_gather_buffers
    deepspeed.py  ZeroConfig, wrap_deepspeed, deepspeed_full_state_dict (`uv sync --extra deepspeed`)

Importing this package never imports deepspeed.
"""

from SimpleTorchLLMRL.distributed.deepspeed import ZeroConfig, deepspeed_full_state_dict, wrap_deepspeed
from SimpleTorchLLMRL.distributed.fsdp import (
    allocate_gather_buffers,
    full_state_dict,
    is_fsdp2,
    reshard,
    sharded_parameters,
    transformer_blocks,
    wrap_fsdp2,
)
from SimpleTorchLLMRL.distributed.launch import (
    DistInfo,
    all_reduce_sum,
    barrier,
    cleanup,
    data_parallel_normalizer,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    shard_indices,
)

__all__ = [
    "DistInfo",
    "ZeroConfig",
    "all_reduce_sum",
    "allocate_gather_buffers",
    "barrier",
    "cleanup",
    "data_parallel_normalizer",
    "deepspeed_full_state_dict",
    "full_state_dict",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_fsdp2",
    "is_main_process",
    "reshard",
    "shard_indices",
    "sharded_parameters",
    "transformer_blocks",
    "wrap_deepspeed",
    "wrap_fsdp2",
]
