"""Messages and rollouts, their exact token encoding, chat templates and rollout files.

    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.chat.tokenize import encode_rollout, rollouts_to_batch
    from SimpleTorchLLMRL.chat.rollout_io import save_rollouts, load_rollouts, RolloutWriter

Nothing is imported here: the front door (`SimpleTorchLLMRL`) holds the names a loop needs.
"""
