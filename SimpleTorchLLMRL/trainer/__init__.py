"""Policy-gradient losses that return tensors.

    from SimpleTorchLLMRL.trainer.grpo import GRPO     # GRPO, Dr. GRPO, DAPO, BNPO, GSPO, CISPO
    from SimpleTorchLLMRL.trainer.ppo import PPO       # value head / critic, GAE
    from SimpleTorchLLMRL.trainer import losses, advantages   # the pure functions underneath
    from SimpleTorchLLMRL.trainer.grpo_loss import grpo_loss  # the GRPO family's loss unit: (loss, metrics)
    from SimpleTorchLLMRL.trainer.combine import combine_metrics  # micro-batch metrics -> the batch's
    from SimpleTorchLLMRL.trainer import batch                 # encode, checks, reference log-probs

Nothing is imported here; import the modules. (The seed's path `SimpleTorchLLMRL.trainer.GRPO`
is served by `SimpleTorchLLMRL.seed`.)
"""
