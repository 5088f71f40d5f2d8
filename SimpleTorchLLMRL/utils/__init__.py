"""Run bookkeeping shared by recipes and users' loops: crash-safe checkpoints and one metrics logger.

    from SimpleTorchLLMRL.utils.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
    from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_jsonl
"""
