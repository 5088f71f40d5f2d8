"""Policy-gradient losses that return tensors.

    from SimpleTorchLLMRL.trainer.GRPO import GRPO     # GRPO, Dr. GRPO, DAPO, BNPO, GSPO, CISPO
    from SimpleTorchLLMRL.trainer.PPO import PPO       # value head / critic, GAE
    from SimpleTorchLLMRL.trainer import losses, advantages   # the pure functions underneath

The classes are not re-exported here on purpose: `SimpleTorchLLMRL.trainer.GRPO`
stays the module (the seed import path `SimpleTorchLLMRL.trainer.GRPO.GRPO`).
"""
