"""The trainer: rollouts and rewards in, a loss tensor out.

    from SimpleTorchLLMRL.trainer.grpo import GRPO        # GRPO, Dr. GRPO, DAPO, BNPO, GSPO, CISPO
    from SimpleTorchLLMRL.trainer.ppo import PPO          # value head / critic, GAE
    from SimpleTorchLLMRL.trainer.distill import Distill  # on-policy distillation (reverse KL, JSD)
    from SimpleTorchLLMRL.trainer.sft import SFT          # and trainer.dpo.DPO
    from SimpleTorchLLMRL.trainer import pipeline, losses # the preparation steps; LossInputs -> LossOutput
    from SimpleTorchLLMRL.trainer.losses import combine_metrics   # micro-batch metrics -> the batch's

Nothing is imported here; import the modules. (The seed's path `SimpleTorchLLMRL.trainer.GRPO`
is served by `SimpleTorchLLMRL.seed`.)
"""
