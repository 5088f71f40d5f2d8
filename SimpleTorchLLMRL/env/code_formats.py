"""Each code data set's test format, read by its meaning into CodeTests (code_tests.py).

    CodeTests.from_humaneval(row)      # prompt, test (def check(candidate)), entry_point
    CodeTests.from_mbpp(row)           # test_list, test_imports, test_setup_code (text / prompt)
    CodeTests.from_apps(row)           # input_output: {"inputs", "outputs", "fn_name"?} as JSON or dict
    CodeTests.from_taco(row)           # the same schema as APPS
    CodeTests.from_livecodebench(row)  # public_test_cases / private_test_cases, metadata {"func_name"}
    CodeTests.from_asserts(src)        # assert lines: a str or a list of str
    CodeTests.from_stdio(cases)        # [{"stdin": ..., "stdout": ...}, ...]
    CodeTests.from_answer(answer)      # any of the above, told apart by its shape (CodeEnv's answers)

Rows are dicts as data set files give them (numpy arrays for lists, NaN for missing cells). Any other
shape is a ValueError naming the accepted ones: a code reward never guesses what a test means.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import pickle
import zlib
from collections.abc import Mapping
from typing import Any

from SimpleTorchLLMRL.env.code_codec import CodecError, encode
from SimpleTorchLLMRL.env.code_replay import RemoteCall, TestProgram, free_names, record
from SimpleTorchLLMRL.env.code_tests import AssertTests, CallTests, CodeTests, StdioTests, top_level_names
from SimpleTorchLLMRL.reward.base import missing_reason

ACCEPTED = (
    "a HumanEval row {prompt, test, entry_point}; an MBPP row {test_list, test_imports?, test_setup_code?}; "
    "an APPS / TACO row {input_output} or its {inputs, outputs, fn_name?}; a LiveCodeBench row "
    "{public_test_cases, private_test_cases?, metadata?}; assert lines (a str or a list of str); "
    "stdin/stdout cases [{'stdin': str, 'stdout': str}, ...]; or a CodeTests"
)


def _missing(value: Any) -> bool:
    try:
        return missing_reason(value) is not None
    except (TypeError, ValueError):  # a numpy array: present
        return False


def _field(row: Mapping, key: str, fmt: str, default: Any = ...) -> Any:
    value = row.get(key, None)
    if _missing(value):
        if default is ...:
            raise ValueError(f"a {fmt} row needs {key!r}, got {value!r} (keys: {sorted(map(str, row))})")
        return default
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _text(row: Mapping, key: str, fmt: str, default: Any = ...) -> str:
    value = _field(row, key, fmt, default)
    if not isinstance(value, str):
        raise ValueError(f"a {fmt} row's {key!r} must be a str, got {type(value).__name__}")
    return value


def _strings(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of str, got {value!r:.200}")
    return list(value)


def _subjects(tests: str, prelude: str, remote: tuple[str, ...], asked: set[str]) -> tuple[str, ...]:
    """The names under test, whose calls go to the sandbox: `remote` (HumanEval's entry point) and the names
    the tests read that nothing binds. Every builtin and stdlib module the tests use stays the caller's own,
    whatever the solution defines: a solution's `def set` never computes `set(f(x)) == set((4, 5))`.

    Tests that call only builtin or stdlib names (`assert max(3) == 9`) test one of them: the one called, or
    the one the task asks for (`asked`: what MBPP's reference code defines); several is a ValueError."""
    bound = top_level_names(prelude)
    free = free_names(tests, bound)
    if free or remote:
        return tuple(dict.fromkeys((*remote, *free)))
    called = {n.func.id for n in ast.walk(ast.parse(tests)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    candidates = free_names(tests, bound, shadowed=called)
    if len(candidates) > 1 and set(candidates) & asked:
        candidates = tuple(n for n in candidates if n in asked)
    if len(candidates) > 1:
        raise ValueError(f"the tests call only builtin or stdlib names ({', '.join(candidates)}), so which one the "
                         "solution provides is ambiguous")
    return candidates


def _asserts(tests: str, prelude: str, fmt: str, *, inside_prelude: str, remote: tuple[str, ...] = (),
             entry: str = "", question: str | None = None, asked: set[str] = frozenset()) -> AssertTests:
    try:
        subjects = _subjects(tests, prelude, remote, asked)
    except SyntaxError as e:
        raise ValueError(f"{fmt} tests are not Python: {e}") from None
    except ValueError as e:
        raise ValueError(f"{fmt} tests cannot decide a reward: {e}") from None
    program = TestProgram(tests, subjects, prelude, entry)
    try:
        recording = record(program)
    except ValueError as e:
        raise ValueError(f"{fmt} tests cannot decide a reward: {e}") from None
    return AssertTests(program, recording, inside_prelude, kind=fmt, question=question)


def from_humaneval(row: Mapping) -> AssertTests:
    """HumanEval: `test` defines `check(candidate)`; it is called with the solution's `entry_point`. The
    prompt runs before the solution (its helpers, e.g. `poly`, exist) and, here, before the tests."""
    prompt, test = _text(row, "prompt", "HumanEval"), _text(row, "test", "HumanEval")
    entry = _text(row, "entry_point", "HumanEval")
    if "check" not in top_level_names(test):
        raise ValueError("a HumanEval row's test must define check(candidate)")
    return _asserts(test, prompt, "humaneval", inside_prelude=prompt, remote=(entry,), entry=f"check({entry})",
                    question=prompt)


def from_mbpp(row: Mapping) -> AssertTests:
    """MBPP (original and sanitized): `test_list` asserts, after `test_imports` and `test_setup_code`."""
    tests = _strings(_field(row, "test_list", "MBPP"), "MBPP's test_list")
    imports = _strings(_field(row, "test_imports", "MBPP", []), "MBPP's test_imports")
    setup = _text(row, "test_setup_code", "MBPP", "")
    prelude = "\n".join([*imports, setup])
    text = row.get("text", row.get("prompt"))
    question = f"{text}\nYour code should pass these tests:\n" + "\n".join(tests) if isinstance(text, str) else None
    return _asserts("\n".join(tests), prelude, "mbpp", inside_prelude=prelude, question=question,
                    asked=_defined(row.get("code")))


def _defined(code: Any) -> set[str]:
    """The functions and classes a data set's reference solution defines (none when it has none, or is not Python 3)."""
    try:
        return {n.name for n in ast.parse(code).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    except (SyntaxError, TypeError, ValueError):
        return set()


def from_asserts(tests: str | list[str]) -> AssertTests:
    """Assert lines (a str, or a list of str as in MBPP's test_list) naming the solution's functions."""
    src = "\n".join(_strings(tests, "assert tests"))
    if not src.strip():
        raise ValueError(f"the assert tests are empty; accepted: {ACCEPTED}")
    return _asserts(src, "", "asserts", inside_prelude="")


def from_stdio(cases: list[Mapping], seconds_per_case: float | None = None) -> StdioTests:
    """[{"stdin": str, "stdout": str}, ...]: the solution is a program; its output is compared token by token."""
    if not cases or not all(isinstance(c, Mapping) and isinstance(c.get("stdin"), str)
                            and isinstance(c.get("stdout"), str) for c in cases):
        raise ValueError(f"stdin/stdout cases must be a non-empty list of {{'stdin': str, 'stdout': str}}, "
                         f"got {cases!r:.200}")
    return StdioTests(tuple(c["stdin"] for c in cases), tuple(c["stdout"] for c in cases),
                      seconds_per_case=seconds_per_case)


def _lines(value: Any) -> str:
    """APPS / TACO stdio text: a str, or a list of lines."""
    if isinstance(value, str):
        return value
    return "\n".join(_strings(value, "an APPS input or output")) + "\n"


def _call(name: str, args: Any, fmt: str, method_of: str | None = "Solution") -> RemoteCall:
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"a {fmt} call's inputs must be a list of arguments, got {args!r:.200}")
    try:
        return RemoteCall(("g", name), (), tuple(("v", encode(a)) for a in args), (), method_of)
    except CodecError as e:
        raise ValueError(f"a {fmt} call's arguments cannot travel: {e}") from None


def from_apps(row: Mapping, seconds_per_case: float | None = None) -> CallTests | StdioTests:
    """APPS / TACO: `input_output` (JSON text or a dict) with `inputs` and `outputs`; call-based when it names
    `fn_name` (inputs[i] the argument list, compared by APPS's rule), else stdin/stdout."""
    spec = row
    if "input_output" in row:
        spec = _field(row, "input_output", "APPS")
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise ValueError(f"an APPS row's input_output is not JSON: {e}") from None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("inputs"), list) or \
            not isinstance(spec.get("outputs"), list) or len(spec["inputs"]) != len(spec["outputs"]) or \
            not spec["inputs"]:
        raise ValueError("an APPS / TACO input_output must hold equal, non-empty lists 'inputs' and 'outputs'")
    question = row.get("question") if isinstance(row.get("question"), str) else None
    fn = spec.get("fn_name")
    if isinstance(fn, str) and fn:
        calls = tuple(_call(fn, a, "APPS") for a in spec["inputs"])
        return CallTests(calls, tuple(spec["outputs"]), compare="apps", kind="apps", question=question)
    return StdioTests(tuple(map(_lines, spec["inputs"])), tuple(map(_lines, spec["outputs"])), kind="apps",
                      question=question, seconds_per_case=seconds_per_case)


from_taco = from_apps


class _TextOnly(pickle.Unpickler):
    def find_class(self, module, name):  # LiveCodeBench pickles a str: nothing else is let in
        raise pickle.UnpicklingError(f"a pickled {module}.{name} is refused")


def _lcb_cases(value: Any) -> list:
    """LiveCodeBench test cases: a list, its JSON, or (private cases) base64 of zlib of a pickled JSON str."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise ValueError(f"LiveCodeBench test cases must be a list or a str, got {type(value).__name__}")
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        text = _TextOnly(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
        return json.loads(text)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"LiveCodeBench test cases are neither JSON nor base64(zlib(pickle(JSON))): {e}") from None


def from_livecodebench(row: Mapping, seconds_per_case: float | None = None) -> CallTests | StdioTests:
    """LiveCodeBench: public (and private) cases {input, output, testtype}. "functional": each input line is a
    JSON argument of `Solution().<metadata func_name>`, the output JSON; "stdin": a program's input/output."""
    cases = _lcb_cases(_field(row, "public_test_cases", "LiveCodeBench", []))
    cases += _lcb_cases(_field(row, "private_test_cases", "LiveCodeBench", []))
    if not cases or not all(isinstance(c, Mapping) and isinstance(c.get("input"), str)
                            and isinstance(c.get("output"), str) for c in cases):
        raise ValueError("a LiveCodeBench row needs test cases {input: str, output: str, testtype}")
    kinds = {c.get("testtype") for c in cases}
    question = row.get("question_content") if isinstance(row.get("question_content"), str) else None
    if kinds == {"stdin"}:
        return StdioTests(tuple(c["input"] for c in cases), tuple(c["output"] for c in cases), kind="livecodebench",
                          question=question, seconds_per_case=seconds_per_case)
    if kinds != {"functional"}:
        raise ValueError(f"LiveCodeBench cases must all be 'functional' or all 'stdin', got {sorted(map(str, kinds))}")
    meta = _field(row, "metadata", "LiveCodeBench")
    meta = json.loads(meta) if isinstance(meta, str) else meta
    name = meta.get("func_name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ValueError("a functional LiveCodeBench row needs metadata {'func_name': ...}")
    try:
        args = [[json.loads(line) for line in c["input"].split("\n") if line.strip()] for c in cases]
        expected = tuple(json.loads(c["output"]) for c in cases)
    except ValueError as e:
        raise ValueError(f"a functional LiveCodeBench case is not JSON: {e}") from None
    calls = tuple(_call(name, a, "LiveCodeBench") for a in args)
    return CallTests(calls, expected, compare="json", kind="livecodebench", question=question)


def from_answer(answer: Any) -> CodeTests:
    """CodeTests from any accepted shape (see ACCEPTED), told apart by its keys or items; ValueError otherwise."""
    if isinstance(answer, CodeTests):
        return answer
    if _missing(answer):
        raise ValueError(f"code tests are missing ({missing_reason(answer)}); accepted: {ACCEPTED}")
    if hasattr(answer, "tolist") and not isinstance(answer, str):
        answer = answer.tolist()
    if isinstance(answer, str):
        return from_asserts(answer)
    if isinstance(answer, Mapping):
        if "entry_point" in answer and "test" in answer:
            return from_humaneval(answer)
        if "test_list" in answer:
            return from_mbpp(answer)
        if "input_output" in answer or ("inputs" in answer and "outputs" in answer):
            return from_apps(answer)
        if "public_test_cases" in answer or "private_test_cases" in answer:
            return from_livecodebench(answer)
    if isinstance(answer, (list, tuple)) and answer:
        if all(isinstance(a, str) for a in answer):
            return from_asserts(list(answer))
        if all(isinstance(a, Mapping) and "stdin" in a for a in answer):
            return from_stdio(list(answer))
    raise ValueError(f"code tests of an unknown shape ({type(answer).__name__}: {answer!r:.120}); accepted: {ACCEPTED}")


for _name, _fn in (("from_humaneval", from_humaneval), ("from_mbpp", from_mbpp), ("from_apps", from_apps),
                   ("from_taco", from_taco), ("from_livecodebench", from_livecodebench),
                   ("from_asserts", from_asserts), ("from_stdio", from_stdio), ("from_answer", from_answer)):
    setattr(CodeTests, _name, staticmethod(_fn))
