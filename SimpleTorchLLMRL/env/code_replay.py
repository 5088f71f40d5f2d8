"""Test code (HumanEval's `check`, MBPP's asserts) run outside the sandbox, the solution's calls inside.

    program = TestProgram(tests="assert add(2, 3) == 5", remote=("add",))
    recording = record(program)             # once: the calls the tests make, and how many asserts
    ... the sandbox computes each call's result as typed data (code_harness.py) ...
    outcome = replay(program, recording, results)   # the tests again, here, on those results
    outcome.passed                          # one bool per assert that ran; outcome.reason when it could not

Every name the solution provides is a *remote*: calling it records a call (first pass, placeholders) or
returns the sandbox's decoded result (second pass). Tests whose calls depend on results cannot be split.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from SimpleTorchLLMRL.env.code_codec import CodecError, encode

_SEED = 20240611
_GUARD = "_stlr_assert"


@dataclass(frozen=True)
class RemoteCall:
    """One call of the solution: base ("g", name) or ("r", index of an earlier call), attributes, arguments.

    An argument is ("v", tokens) (typed data, code_codec) or ("r", k) (the live result of call k).
    method_of: a class the harness instantiates when `name` is not a global (LeetCode's `Solution`).
    """

    base: tuple[str, Any]
    attrs: tuple[str, ...] = ()
    args: tuple[tuple[str, Any], ...] = ()
    kwargs: tuple[tuple[str, tuple[str, Any]], ...] = ()
    method_of: str | None = None

    def to_json(self) -> dict:
        return {"base": list(self.base), "attrs": list(self.attrs), "args": [list(a) for a in self.args],
                "kwargs": [[k, list(v)] for k, v in self.kwargs], "method_of": self.method_of}


@dataclass(frozen=True)
class TestProgram:
    """Test code to run outside. prelude: the data set's code it needs (HumanEval's prompt, MBPP's setup);
    tests: the test code; entry: a statement run after it (HumanEval: `check(<entry point>)`); remote: the
    names the solution provides (calls to them go to the sandbox)."""

    tests: str
    remote: tuple[str, ...]
    prelude: str = ""
    entry: str = ""


@dataclass(frozen=True)
class Recording:
    calls: tuple[RemoteCall, ...]
    asserts: int  # asserts that ran in the first pass: what the second must match
    assert_ends: tuple[int, ...] = ()  # calls made by the end of each assert
    handles: frozenset[int] = frozenset()  # calls whose results later calls use as live objects
    unsplit: str | None = None  # why these tests cannot be split, when they cannot


@dataclass
class Outcome:
    passed: list[bool] = field(default_factory=list)  # one per assert that ran in the second pass
    reason: str | None = None  # why the second pass did not finish as the first did (None: it did)
    unsplit: bool = False  # the tests' calls depend on the results: not decidable outside


class _Mismatch(BaseException):
    """The second pass made a call the first did not: its calls depend on the results."""


class RemoteError(Exception):
    """A call of the solution that raised, or whose result cannot travel, in the sandbox."""


# ---- the names the solution provides --------------------------------------------------------------------

class _Remote:
    """A name of the solution's (or an attribute of a live result): calling it is a call in the sandbox."""

    __slots__ = ("_pass", "_base", "_attrs")

    def __init__(self, pass_, base, attrs=()):
        object.__setattr__(self, "_pass", pass_)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_attrs", attrs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Remote(self._pass, self._base, (*self._attrs, name))

    def __call__(self, *args, **kwargs):
        return self._pass.call(self._base, self._attrs, args, kwargs)

    def __repr__(self):
        return f"<solution's {'.'.join(map(str, (self._base[1], *self._attrs)))}>"


class _Placeholder(_Remote):
    """First pass: the result of a call, not known yet. Lets the tests run on; used as an argument it is
    the live result (a handle); anything computed from it is a placeholder that cannot be an argument."""

    __slots__ = ()

    def __bool__(self):
        return True

    def __len__(self):
        return 0

    def __iter__(self):
        return iter(())

    def __index__(self):
        return 0

    def __int__(self):
        return 0

    def __float__(self):
        return 0.0

    def __hash__(self):
        return id(self)

    def __contains__(self, item):
        return True

    def _derived(self, *_, **__):
        return _Placeholder(self._pass, ("derived", None))

    def _holds(self, *_):
        return True

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _holds
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _derived
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = _derived
    __abs__ = __round__ = __getitem__ = __and__ = __or__ = __xor__ = __invert__ = _derived


class _Handle(_Remote):
    """Second pass: the live result of a call, in the sandbox (an object that cannot travel, or one that
    later calls use). Only its attributes can be called; anything else is an error in the test using it."""

    __slots__ = ()

    def __bool__(self):
        raise RemoteError("the solution returned an object that cannot travel as data")

    def __eq__(self, other):
        raise RemoteError("the solution returned an object that cannot travel as data")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__
    __hash__ = None


# ---- the two passes --------------------------------------------------------------------------------------

class _Pass:
    def __init__(self, recording: Recording | None = None, results: dict[int, tuple] | None = None):
        self.recording, self.results = recording, results
        self.calls: list[RemoteCall] = []  # the calls made so far
        self.ends: list[int] = []  # len(self.calls) at the end of each assert
        self.handles: set[int] = set()
        self.unsplit: str | None = None
        self.asserts: list[bool] = []

    def entry(self, value) -> tuple[str, Any]:
        if isinstance(value, _Remote):
            if value._base[0] == "r" and not value._attrs:
                self.handles.add(value._base[1])
                return ("r", value._base[1])
            raise CodecError(f"an argument computed from the solution's results ({value!r})")
        return ("v", encode(value))

    def call(self, base, attrs, args, kwargs):
        try:
            if base[0] == "derived":
                raise CodecError("a call on a value computed from the solution's results")
            call = RemoteCall(base, tuple(attrs), tuple(self.entry(a) for a in args),
                              tuple((k, self.entry(v)) for k, v in kwargs.items()))
        except CodecError as e:
            if self.results is None:
                self.unsplit = self.unsplit or f"a call's arguments cannot travel: {e}"
                return _Placeholder(self, ("derived", None))
            raise _Mismatch(str(e)) from None
        if base[0] == "r":
            self.handles.add(base[1])
        k = len(self.calls)
        self.calls.append(call)
        if self.results is None:
            return _Placeholder(self, ("r", k))
        expected = self.recording.calls
        if k >= len(expected) or expected[k] != call:
            raise _Mismatch(f"call {k} differs from the first pass")
        return self.result(k)

    def result(self, k):
        got = self.results.get(k)
        if got is None:
            raise RemoteError(f"call {k} has no result (the run ended before it)")
        if got[0] == "ok" and k not in self.recording.handles:
            return got[1]
        if got[0] in ("ok", "opaque"):
            return _Handle(self, ("r", k))
        raise RemoteError(f"call {k} raised in the sandbox: {got[1]}")

    def check(self, thunk):
        """An assert of the tests: run it; first pass: count it; second: record whether it held.

        An assert that fails part-way (`tuple(candidate(x)) == tuple(f(x))` on a None result) skips the
        calls it did not reach, so the asserts after it still line up with the first pass."""
        try:
            held = bool(thunk())
        except _Mismatch:
            raise
        except Exception:  # noqa: BLE001  (AssertionError-free: a test that raises did not hold)
            held = False
        self.asserts.append(held)
        if self.recording is not None:
            i = len(self.asserts) - 1
            end = self.recording.assert_ends[i] if i < len(self.recording.assert_ends) else -1
            if not held and 0 <= len(self.calls) < end:
                self.calls += self.recording.calls[len(self.calls):end]
            if len(self.calls) != end:
                raise _Mismatch(f"assert {i} made other calls than in the first pass")
        self.ends.append(len(self.calls))


class _GuardAsserts(ast.NodeTransformer):
    """`assert X, msg` -> `_stlr_assert(lambda: X)`; `assert <constant>` (HumanEval's `assert True`) is dropped."""

    def visit_Assert(self, node):
        if isinstance(node.test, ast.Constant):
            return ast.Pass()
        call = ast.Call(ast.Name(_GUARD, ast.Load()),
                        [ast.Lambda(ast.arguments([], [], None, [], [], None, []), self.visit(node.test))], [])
        return ast.copy_location(ast.Expr(call), node)


def _private_random() -> types.ModuleType:
    """A `random` module of the tests' own: seeded, so both passes draw the same, and shared with no one."""
    rng = random.Random(_SEED)
    module = types.ModuleType("random")
    for name in dir(random):
        if not name.startswith("_"):
            setattr(module, name, getattr(rng, name, getattr(random, name)))

    class Random(random.Random):
        def __init__(self, x=None):
            super().__init__(_SEED if x is None else x)

    module.Random = Random
    return module


def _builtins() -> dict:
    names = dict(vars(builtins))
    rnd = _private_random()
    real_import = builtins.__import__

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "random" and level == 0:
            return rnd
        return real_import(name, globals, locals, fromlist, level)

    names["__import__"] = guarded_import
    return names


def free_names(tests: str, bound: set[str], *, shadowed: set[str] = frozenset()) -> tuple[str, ...]:
    """Names the tests read but never bind (nor does `bound`, nor builtins, nor a stdlib module): the solution's.
    shadowed: names that count as the solution's even where a builtin or a stdlib module has them (the function
    under test of `assert max(3) == 9`)."""
    tree = ast.parse(tests)
    loaded, stored = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
        elif isinstance(node, ast.alias):
            stored.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            stored.add(node.name)
    free = loaded - stored - bound
    return tuple(sorted(n for n in free if n in shadowed or (n not in sys.stdlib_module_names
                                                              and not hasattr(builtins, n))))


def _namespace(program: TestProgram, pass_: _Pass) -> dict:
    ns: dict[str, Any] = {"__name__": "__tests__", "__builtins__": _builtins()}
    exec(_compiled(program.prelude, "<prelude>"), ns)
    for n in _names_read(program.tests):
        if n in sys.stdlib_module_names and n not in ns and n not in program.remote and not hasattr(builtins, n):
            ns[n] = importlib.import_module(n)  # `math.isclose(...)` in tests that forgot `import math`
    for name in program.remote:
        ns[name] = _Remote(pass_, ("g", name))
    ns[_GUARD] = pass_.check
    return ns


@functools.lru_cache(maxsize=1024)
def _compiled(src: str, filename: str) -> types.CodeType:
    """`src` compiled once (a data set's prelude or entry runs in every pass of every verdict)."""
    return compile(src, filename, "exec")


@functools.lru_cache(maxsize=1024)
def _names_read(tests: str) -> frozenset[str]:
    return frozenset(node.id for node in ast.walk(ast.parse(tests)) if isinstance(node, ast.Name))


@functools.lru_cache(maxsize=1024)
def _guarded(tests: str) -> types.CodeType:
    """The tests compiled with each assert in its guard (compiled once; code objects are shared read-only)."""
    return compile(ast.fix_missing_locations(_GuardAsserts().visit(ast.parse(tests))), "<tests>", "exec")


def _run(program: TestProgram, pass_: _Pass) -> None:
    ns = _namespace(program, pass_)
    exec(_guarded(program.tests), ns)
    if program.entry:
        exec(_compiled(program.entry, "<tests>"), ns)


def record(program: TestProgram) -> Recording:
    """The first pass: the calls the tests make and the asserts they run. ValueError for tests that make no
    call of the solution, or fail on their own (their prelude or code raises before any call)."""
    pass_ = _Pass()
    try:
        _run(program, pass_)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a data set's test that calls exit() ends here)
        if not pass_.calls:
            raise ValueError(f"the tests raise {type(e).__name__}: {e} before calling the solution") from None
        pass_.unsplit = pass_.unsplit or f"the tests raise {type(e).__name__} on placeholder results"
    if not pass_.calls:
        raise ValueError(f"the tests never call the solution (it provides {', '.join(program.remote) or 'nothing'})")
    if not pass_.asserts:
        raise ValueError("the tests run no assert: nothing would decide a reward")
    return Recording(tuple(pass_.calls), len(pass_.asserts), tuple(pass_.ends), frozenset(pass_.handles),
                     pass_.unsplit)


def replay(program: TestProgram, recording: Recording, results: dict[int, tuple]) -> Outcome:
    """The second pass: the tests on the sandbox's results (`{call index: ("ok", value) | ("opaque", why) |
    ("error", why)}`). Never raises for anything in `results`."""
    if recording.unsplit:
        return Outcome(reason=recording.unsplit, unsplit=True)
    pass_ = _Pass(recording, results)
    try:
        _run(program, pass_)
    except _Mismatch as e:
        return Outcome(pass_.asserts, f"the tests' calls depend on the solution's results: {e}", unsplit=True)
    except RecursionError:
        return Outcome(pass_.asserts, "the tests hit the recursion limit")
    except (Exception, SystemExit) as e:  # noqa: BLE001  (e.g. a call that raised, outside an assert)
        return Outcome(pass_.asserts, f"the tests stopped: {type(e).__name__}: {str(e)[:200]}")
    if len(pass_.calls) != len(recording.calls) or len(pass_.asserts) != recording.asserts:
        return Outcome(pass_.asserts, "the tests took another path than in the first pass", unsplit=True)
    return Outcome(pass_.asserts)
