"""SimpleTorchLLMRL: small, composable PyTorch primitives for RL on language models."""

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.chat.tokenize import Batch, EncodedRollout, collate, encode_prompt, encode_rollout, encode_rollouts

__all__ = [
    "Batch",
    "EncodedRollout",
    "Message",
    "MessageType",
    "Rollout",
    "collate",
    "encode_prompt",
    "encode_rollout",
    "encode_rollouts",
]
