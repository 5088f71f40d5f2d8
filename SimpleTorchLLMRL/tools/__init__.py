"""Tools for agents: `Tool` / `@tool`, `ToolRegistry`, call parsers, a calculator and a python sandbox."""

from SimpleTorchLLMRL.tools.base import (
    CalculatorError,
    Tool,
    ToolArgumentError,
    calculator,
    evaluate,
    format_result,
    tool,
)
from SimpleTorchLLMRL.tools.parsers import (
    CodeBlockParser,
    JsonToolCallParser,
    TagToolCallParser,
    ToolCall,
    format_json_call,
    parse_tool_calls,
)
from SimpleTorchLLMRL.tools.registry import ToolRegistry, ToolResult
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox, SandboxResult, python_tool, run_python

__all__ = [
    "CalculatorError",
    "CodeBlockParser",
    "JsonToolCallParser",
    "PythonSandbox",
    "SandboxResult",
    "TagToolCallParser",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "calculator",
    "evaluate",
    "format_json_call",
    "format_result",
    "parse_tool_calls",
    "python_tool",
    "run_python",
    "tool",
]
