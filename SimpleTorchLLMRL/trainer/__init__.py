"""Policy-gradient losses that return tensors.

    from SimpleTorchLLMRL.trainer.GRPO import GRPO     # GRPO, Dr. GRPO, DAPO, BNPO, GSPO, CISPO
    from SimpleTorchLLMRL.trainer.PPO import PPO       # value head / critic, GAE
    from SimpleTorchLLMRL.trainer import losses, advantages   # the pure functions underneath
    from SimpleTorchLLMRL.trainer.grpo_loss import grpo_loss  # the GRPO family's loss unit: (loss, metrics)
    from SimpleTorchLLMRL.trainer.combine import combine_metrics  # micro-batch metrics -> the batch's
    from SimpleTorchLLMRL.trainer import batch                 # encode, checks, reference log-probs

The classes are not re-exported here on purpose: `SimpleTorchLLMRL.trainer.GRPO`
stays the module (the seed import path `SimpleTorchLLMRL.trainer.GRPO.GRPO`).
"""
