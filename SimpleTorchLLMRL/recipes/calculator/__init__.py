"""The calculator GRPO recipe behind `main.py`: a tiny model learns to call a calculator tool and box the answer.

arithmetic (the task and its dataset), cli (flags and their checks), data (JSONL / Parquet / HF rows),
train_loop (seeding, schedules, sampler, final model), evaluate (pass@k, tables), plots (curves).
"""
