"""The DeepSpeed path: config building and the install hint always; a real ZeRO-2 step when deepspeed is there.

deepspeed is an optional extra (`uv sync --extra deepspeed`); without it the
engine test is skipped and the rest still runs.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch

from SimpleTorchLLMRL.distributed.deepspeed import (
    ZeroConfig,
    deepspeed_available,
    deepspeed_full_state_dict,
    import_deepspeed,
    wrap_deepspeed,
)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def test_zero2_config_dict():
    cfg = ZeroConfig(stage=2, micro_batch_size=4, grad_accum=2, bf16=True, offload_optimizer=True).to_dict()
    assert cfg == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "bf16": {"enabled": True},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
    }


def test_zero3_config_dict_and_extra_merge():
    cfg = ZeroConfig(stage=3, offload_params=True, gradient_clipping=None,
                     extra={"zero_optimization": {"reduce_bucket_size": 5e7}, "steps_per_print": 10}).to_dict()
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["reduce_bucket_size"] == 5e7 and zero["overlap_comm"] is True  # merged, not replaced
    assert cfg["steps_per_print"] == 10 and "gradient_clipping" not in cfg


@pytest.mark.parametrize("kwargs,word", [
    (dict(stage=1), "stage"), (dict(micro_batch_size=0), "micro_batch_size"), (dict(grad_accum=1.5), "grad_accum"),
    (dict(bf16=True, fp16=True), "exclusive"), (dict(offload_params=True), "stage=3"),
    (dict(gradient_clipping=0), "gradient_clipping"),
])
def test_zero_config_rejects(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ZeroConfig(**kwargs)


def test_missing_deepspeed_says_how_to_install(monkeypatch, qwen2_model):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    assert not deepspeed_available()
    with pytest.raises(ImportError, match="uv sync --extra deepspeed"):
        import_deepspeed()
    with pytest.raises(ImportError, match="uv sync --extra deepspeed"):
        wrap_deepspeed(qwen2_model, torch.optim.AdamW(qwen2_model.parameters()))


def test_module_import_does_not_import_deepspeed():
    import subprocess

    code = ("import sys, SimpleTorchLLMRL.distributed.deepspeed as m; "
            "print('deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_DEEPSPEED and torch.cuda.is_available()),
                    reason="needs the deepspeed extra (uv sync --extra deepspeed) and a CUDA device")
def test_zero2_grpo_step_matches_plain_torch(monkeypatch, chatml_tokenizer):  # pragma: no cover - needs GPU
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.testing.tiny import tiny_model
    from SimpleTorchLLMRL.trainer.grpo import GRPO

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517").items():
        monkeypatch.setenv(k, v)
    tok = chatml_tokenizer
    rollouts = [Rollout([Message(f"q{g}"), Message(tok.decode(ids), MessageType.MODEL, token_ids=ids)])
                for g, ids in enumerate([[40, 41, 42], [43, 44, 45, 46], [47, 48], [49, 50, 51]])]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2])
    model = tiny_model("qwen2", tok).cuda().train()
    plain = copy.deepcopy(model)

    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    GRPO(plain, tok, group_size=2).calculate_loss(rollouts, rewards).backward()
    opt.step()

    engine, _ = wrap_deepspeed(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                               ZeroConfig(stage=2, micro_batch_size=4, gradient_clipping=None))
    loss = GRPO(engine.module, tok, group_size=2).calculate_loss(rollouts, rewards)
    engine.backward(loss)
    engine.step()
    sd = deepspeed_full_state_dict(engine)
    for name, w in plain.state_dict().items():
        assert torch.allclose(sd[name], w.cpu(), atol=1e-5), name
