"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for transformers and peft models (docs/scale.md).

    model = wrap_fsdp2(model)                        # under torchrun: each decoder block, then the root
    optimizer = torch.optim.AdamW(sharded_parameters(model))   # the DTensor shards
    sd = full_state_dict(model)                      # rank 0: full CPU tensors, others: {}

Gradients are the mean over ranks (pass `data_parallel_normalizer`). The root group (embeddings, final norm,
head) stays gathered after a forward until the next backward, because the log-probs apply the head outside it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

_MP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
              "fp32": torch.float32, "float32": torch.float32}


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the same object otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of a (peft-wrapped) transformers model, in order.

    Uses the model's `_no_split_modules` class names (what HF itself treats as
    the unit of sharding); falls back to the children of the longest ModuleList.
    """
    base = _unwrap(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [m for m in base.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"cannot find transformer blocks in {type(base).__name__}: no _no_split_modules and no "
                         "ModuleList; pass blocks= to wrap_fsdp2")
    return list(max(lists, key=len))


def mixed_precision_policy(mixed_precision):
    """None, a `MixedPrecisionPolicy`, or "bf16" / "fp16" / "fp32" (params in that dtype, grads reduced in fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision in _MP_DTYPES:
        return MixedPrecisionPolicy(param_dtype=_MP_DTYPES[mixed_precision], reduce_dtype=torch.float32)
    raise ValueError(
        f"mixed_precision must be None, a torch.distributed.fsdp.MixedPrecisionPolicy, or one of "
        f"{sorted(_MP_DTYPES)}, got {mixed_precision!r}"
    )


def wrap_fsdp2(model: nn.Module, mesh=None, mixed_precision=None, *, reshard_after_forward: bool = True,
               cpu_offload: bool = False, blocks: Iterable[nn.Module] | None = None) -> nn.Module:
    """Shard `model` (plain or peft) in place with FSDP2: each transformer block, then the root; returns it.

    `reshard_after_forward` applies to the blocks; the root group stays gathered (module docstring).
    `mesh`: a 1-D DeviceMesh (None: all ranks). The model must be on the process's device (CPU with gloo,
    its CUDA device with nccl). Build the optimizer from `sharded_parameters(model)`.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()):
        raise ValueError("wrap_fsdp2 does not shard bitsandbytes 4/8-bit weights; train QLoRA on one device per "
                         "process (data parallel), or use LoRA on a bf16 base with FSDP2")
    if not torch.distributed.is_initialized():
        raise RuntimeError("wrap_fsdp2 needs an initialized process group: call init_distributed() under torchrun")
    kwargs = dict(mesh=mesh)
    policy = mixed_precision_policy(mixed_precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in list(blocks) if blocks is not None else transformer_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root is the transformers model itself, also under a peft wrapper: PeftModel.generate calls the
    # inner model directly, so FSDP's hooks must sit there. Its group (embeddings, final norm, output head)
    # stays gathered after forward: token_logprobs applies the head outside the forward, chunk by chunk.
    fully_shard(_unwrap(model), reshard_after_forward=False, **kwargs)
    return model


def allocate_gather_buffers(model: nn.Module, input_ids: torch.Tensor | None = None) -> None:
    """One no-grad forward so FSDP2 allocates its all-gather buffers as ordinary tensors: made first under
    `torch.inference_mode()` (generation) they would fail every later training forward ("Inplace update to
    inference tensor outside InferenceMode"). Call it once after `wrap_fsdp2`, on every rank, before generating.
    """
    if input_ids is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        input_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=input_ids)
    reshard(model)


def reshard(model: nn.Module) -> None:
    """Free every gathered parameter (the root group stays gathered after a forward until backward).

    While the root group is gathered, `model.parameters()` yields its full
    tensors instead of the DTensor shards: build optimizers only when resharded.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in (model, _unwrap(model)):
        if isinstance(m, FSDPModule):
            m.reshard()
            return


def sharded_parameters(model: nn.Module, trainable_only: bool = True) -> list[torch.Tensor]:
    """The parameters to give the optimizer: reshards first, so they are the DTensor shards FSDP2 updates."""
    reshard(model)
    return [p for p in model.parameters() if p.requires_grad or not trainable_only]


def is_fsdp2(model: nn.Module) -> bool:
    """True for a model sharded by `wrap_fsdp2` (for peft models the inner transformers model is the root)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or isinstance(_unwrap(model), FSDPModule)


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict with the model's own names (peft prefixes kept); a collective.

    cpu_offload=True: rank 0 gets CPU tensors, the others {}; False: every rank gets full tensors on its
    device. A model that is not sharded returns its plain state_dict (detached).
    """
    if not is_fsdp2(model):
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        return {k: v.cpu() for k, v in sd.items()} if cpu_offload else sd
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(model)  # a gathered root group would hand over full tensors instead of its shards
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    return get_model_state_dict(model, options=options)
