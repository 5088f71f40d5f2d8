"""Run bookkeeping shared by recipes and users' loops: crash-safe checkpoints, one metrics logger,
one JSONL reader, and the steps every training loop shares.

    from SimpleTorchLLMRL.utils.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
    from SimpleTorchLLMRL.utils.metrics import MetricsLogger, read_metrics
    from SimpleTorchLLMRL.utils.jsonl import read_jsonl
"""
