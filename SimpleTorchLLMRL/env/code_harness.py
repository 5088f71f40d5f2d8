"""The program CodeEnv runs in the sandbox: it computes values, and never decides a verdict.

`harness_program(job)` (code.py) is code_codec.py's source, this file's, then `_stlr_main(job literal)`.
It runs the data set's prelude and the solution, then by the job's mode: "calls" (each call the tests
make of the solution, its result sent back as typed data, "opaque" or the error it raised), "stdio" (the
solution once per case in a forked child, fd 0 the input, fd 1 a fresh file) or "inside" (the tests in
the solution's namespace, an opt-in). fd 3 holds a per-run nonce, fd 4 is the report: the nonce, then
one flat JSON array per line; forging it gains nothing. Standard library only, loaded modules only
(plus `time`): it runs under `python -I` in every run.
"""

import io
import os
import sys
import time

try:  # in the sandbox, code_codec.py's source comes first in the same program
    decode, encode  # noqa: B018
except NameError:
    from SimpleTorchLLMRL.env.code_codec import decode, encode

_OUT_LIMIT = 1 << 20  # bytes of a stdio case's output kept


_JSON_ESCAPES = {**{c: f"\\u{c:04x}" for c in (*range(32), *range(0xD800, 0xE000))}, 34: '\\"', 92: "\\\\"}


def _stlr_json(item):
    """A str, int or float as JSON text (the report's lines are flat arrays of these), without `json`."""
    if type(item) is str:
        return '"' + item.translate(_JSON_ESCAPES) + '"'
    return repr(int(item)) if type(item) is int else repr(float(item))


def _stlr_write(line):
    data = ("[" + ", ".join(map(_stlr_json, line)) + "]\n").encode("utf-8")
    while data:
        data = data[os.write(4, data):]


def _stlr_empty_stdin():
    """fd 0 held this program's source: point it at an empty file, so a solution reads no harness."""
    fd = os.memfd_create("stdin")
    os.dup2(fd, 0)
    os.close(fd)


def _stlr_namespace(name):
    return {"__name__": name, "__builtins__": __builtins__}


def _stlr_value(entry, objects):
    if entry[0] == "r":  # the result of an earlier call, as the live object
        return objects[entry[1]]
    return decode(entry[1])


def _stlr_target(call, namespace, objects):
    kind, key = call["base"]
    if kind == "r":
        target = objects[key]
    elif key in namespace:
        target = namespace[key]
    elif call.get("method_of") in namespace:  # LeetCode style: `class Solution` with the method
        target = getattr(namespace[call["method_of"]](), key)
    else:
        raise NameError(f"name {key!r} is not defined")
    for attr in call["attrs"]:
        target = getattr(target, attr)
    return target


def _stlr_calls(job):
    namespace = _stlr_namespace("__solution__")
    objects = {}
    try:
        exec(compile(job["prelude"], "<prelude>", "exec"), namespace)
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001  (SystemExit too: the solution never got to the calls)
        for k in range(len(job["calls"])):
            _stlr_write([k, "error", f"the solution did not load: {type(e).__name__}"])
        return
    for k, call in enumerate(job["calls"]):
        try:
            target = _stlr_target(call, namespace, objects)
            args = [_stlr_value(a, objects) for a in call["args"]]
            kwargs = {name: _stlr_value(a, objects) for name, a in call["kwargs"]}
            result = target(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            _stlr_write([k, "error", f"{type(e).__name__}: {str(e)[:200]}"])
            continue
        objects[k] = result
        try:
            tokens = encode(result)
        except Exception as e:  # noqa: BLE001  (a value that cannot travel: usable by later calls only)
            _stlr_write([k, "opaque", str(e)[:200]])
            continue
        _stlr_write([k, "ok", *tokens])


def _stlr_file(data):
    fd = os.memfd_create("case")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _stlr_child(job, stdin_fd, out_fd):
    os.dup2(stdin_fd, 0)
    os.dup2(out_fd, 1)
    for fd in (stdin_fd, out_fd, 4):
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    code = 0
    try:
        namespace = _stlr_namespace("__main__")
        exec(compile(job["prelude"], "<prelude>", "exec"), namespace)
        exec(compile(job["solution"], "<solution>", "exec"), namespace)
    except SystemExit as e:  # sys.exit() / exit(0) end a program normally
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        code = 1
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        code = code or 1
    os._exit(code & 0xFF)


def _stlr_wait(pid, seconds):
    """The child's exit code (negative: its signal), or None when it outlived `seconds` (then killed)."""
    deadline, pause = time.monotonic() + seconds, 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _stlr_stdio(job):
    for k, stdin in enumerate(job["cases"]):
        stdin_fd, out_fd = _stlr_file(stdin.encode("utf-8", "surrogatepass")), _stlr_file(b"")
        pid = os.fork()
        if pid == 0:
            _stlr_child(job, stdin_fd, out_fd)
        os.close(stdin_fd)
        status = _stlr_wait(pid, job["case_seconds"])
        size = os.fstat(out_fd).st_size
        out = os.pread(out_fd, _OUT_LIMIT, 0)
        os.close(out_fd)
        if status is None:
            _stlr_write([k, "timeout"])
        elif size > _OUT_LIMIT:
            _stlr_write([k, "error", f"more than {_OUT_LIMIT} bytes of output"])
        else:
            _stlr_write([k, "out", out.decode("utf-8", "replace"), status])


def _stlr_inside(job):
    seen = [0]

    def _stlr_seen():
        seen[0] += 1

    namespace = _stlr_namespace("__main__")
    namespace["_stlr_seen"] = _stlr_seen
    exec(compile(job["prelude"], "<prelude>", "exec"), namespace)
    exec(compile(job["solution"], "<solution>", "exec"), namespace)
    exec(compile(job["tests"], "<tests>", "exec"), namespace)
    _stlr_write(["end", seen[0]])


def _stlr_main(job):
    nonce = os.read(3, 64)
    os.close(3)
    os.write(4, nonce + b"\n")
    _stlr_empty_stdin()
    {"calls": _stlr_calls, "stdio": _stlr_stdio, "inside": _stlr_inside}[job["mode"]](job)
