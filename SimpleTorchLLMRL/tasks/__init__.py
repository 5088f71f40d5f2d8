"""Synthetic tasks with verifiable answers (the embedded tiny model is warmed up on `arithmetic`)."""

from SimpleTorchLLMRL.tasks.arithmetic import (
    CALCULATOR_SCHEMA,
    SYSTEM_PROMPT,
    Problem,
    build_dataset,
    check_answer,
    extract_boxed,
    format_tool_call,
    generate_problems,
    iter_problems,
    parse_tool_call,
    run_calculator,
    safe_eval,
    solution_rollout,
    split_of,
    write_jsonl,
)

__all__ = [
    "CALCULATOR_SCHEMA",
    "SYSTEM_PROMPT",
    "Problem",
    "build_dataset",
    "check_answer",
    "extract_boxed",
    "format_tool_call",
    "generate_problems",
    "iter_problems",
    "parse_tool_call",
    "run_calculator",
    "safe_eval",
    "solution_rollout",
    "split_of",
    "write_jsonl",
]
