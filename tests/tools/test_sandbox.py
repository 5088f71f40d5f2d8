"""The python sandbox contains what model-written code can throw at it, and the parent keeps running."""

import os
import resource
import signal
import socket
import time
import uuid

import pytest

from SimpleTorchLLMRL.tools import PythonSandbox, SandboxResult, ToolRegistry, landlock, python_tool
from tests.support.sandbox_attack_helpers import kill_survivors, name_code, new_marker, survivors

ROOT = os.geteuid() == 0
LANDLOCK = landlock.abi_version()


@pytest.fixture(scope="module")
def box():
    return PythonSandbox(timeout=5, memory_mb=512, max_processes=16, max_output_bytes=4096)


def test_runs_code_isolated_in_an_empty_directory(box):
    r = box.run("import os, sys\nprint(sys.flags.isolated, os.listdir('.'), sorted(os.environ))\nprint(6 * 7)")
    assert r.ok and not r.timed_out and not r.truncated and r.stderr == ""
    assert r.stdout == "1 [] ['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']\n42\n"
    assert r.to_text() == "1 [] ['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']\n42"


def test_errors_are_reported_not_raised(box):
    r = box.run("x = 1\nraise ValueError('nope')")
    assert r.exit_code == 1 and not r.ok
    assert "ValueError: nope" in r.stderr
    assert r.to_text().endswith("ValueError: nope\n[exit code 1]")
    assert box.run("").to_text() == "[no output]"


def test_infinite_loop_hits_the_wall_clock_timeout():
    r = PythonSandbox(timeout=1).run("while True:\n    pass")
    assert r.timed_out and r.exit_code == -signal.SIGKILL
    assert 0.9 < r.seconds < 4.0
    assert r.to_text() == "[timed out after 1 s]"


def test_cpu_limit_kills_a_busy_process():
    r = PythonSandbox(timeout=30, cpu_seconds=1).run("while True:\n    pass")
    assert not r.timed_out and r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert r.seconds < 15
    assert "[terminated by signal SIGXCPU (CPU time limit)]" in r.to_text() or "SIGKILL" in r.to_text()


@pytest.mark.parametrize("code", [
    "x = bytearray(4 * 1024 ** 3)",
    "chunks = []\nwhile True:\n    chunks.append(b'x' * 10 ** 7)",
])
def test_memory_bomb_is_stopped(box, code):
    r = box.run(code)
    assert not r.ok and not r.timed_out
    assert "MemoryError" in r.stderr or r.exit_code < 0
    assert r.seconds < 5


def test_fork_bomb_is_bounded_and_cleaned_up(box):
    marker = new_marker()  # the PIDs the run prints are its own namespace's: find survivors by name instead
    code = name_code(marker) + (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        print('fork refused:', e.errno)\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        {'os.setsid()' if ROOT else 'pass'}\n"  # escape the process group: still found by uid
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print('PIDS', *pids)\n"
    )
    r = box.run(code)
    assert "fork refused: 11" in r.stdout  # EAGAIN from RLIMIT_NPROC
    pids = [int(p) for p in r.stdout.split("PIDS")[1].split()]
    assert len(pids) < box.max_processes  # without root the limit counts all of the user's processes
    assert len(pids) > 0 or not ROOT
    time.sleep(0.2)
    assert survivors(marker) == [], kill_survivors(marker)  # nothing outlives the run
    assert box.run("print('still fine')").stdout == "still fine\n"


def test_huge_print_is_truncated_while_reading(box):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    r = box.run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\nprint('end')")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.truncated and r.exit_code == 0
    assert r.stdout == "x" * box.max_output_bytes
    assert grown_mb < 50  # the 100 MB were never buffered in the parent
    assert r.to_text().endswith(f"[output truncated to {box.max_output_bytes} bytes per stream]")


def test_file_size_limit(box):
    r = PythonSandbox(file_size_mb=1).run("open('big', 'wb').write(b'x' * 2 * 1024 * 1024)")
    assert r.exit_code == 1 and "File too large" in r.stderr


@pytest.mark.skipif(not (ROOT or LANDLOCK), reason="confining writes needs root (uid drop) or Landlock")
def test_writes_outside_the_working_directory_are_refused(box, tmp_path):
    outside_tmp = f"/tmp/stlr-escape-{uuid.uuid4().hex}"
    parent_dir = tmp_path / f"escape-{uuid.uuid4().hex}"  # under a root-only 0700 directory when root
    sibling = f"../stlr-escape-{uuid.uuid4().hex}"  # next to the working directory, in /tmp
    targets = [str(parent_dir)] + ([outside_tmp, sibling] if LANDLOCK else [])  # /tmp is world-writable
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print('inside', open('inside.txt').read(), os.getcwd())\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', type(e).__name__)\n"
    )
    r = box.run(code)
    assert r.ok, r.to_text()
    refused = r.stdout.count("refused PermissionError") + r.stdout.count("refused FileNotFoundError")
    assert "WROTE" not in r.stdout and refused == len(targets)  # FileNotFound: the path is not in the run's view
    workdir = r.stdout.split()[2]
    assert not os.path.exists(outside_tmp) and not parent_dir.exists()
    assert not os.path.exists(os.path.join(os.path.dirname(workdir), sibling[3:]))
    assert not os.path.exists(workdir)  # the working directory is deleted afterwards


def test_parent_environment_does_not_leak(box, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STLR_SECRET_TOKEN", secret)
    code = "import os\nprint(dict(os.environ))\n"
    if ROOT:  # as another uid, the parent's /proc entry is unreadable (same uid could read it)
        code += ("for p in (os.getppid(), 1):\n"
                 "    try:\n"
                 "        print(open(f'/proc/{p}/environ').read())\n"
                 "    except OSError as e:\n"
                 "        print('refused', type(e).__name__)\n")
    r = box.run(code)
    assert r.ok, r.to_text()
    assert secret not in r.stdout + r.stderr and "STLR_SECRET_TOKEN" not in r.stdout
    if ROOT:
        assert r.stdout.count("refused PermissionError") == 2


@pytest.mark.skipif(not (ROOT or LANDLOCK >= 6), reason="needs another uid or Landlock signal scoping")
def test_cannot_signal_the_parent(box):
    r = box.run("import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGTERM)\n    print('SENT')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)")
    assert r.stdout == "refused PermissionError\n"


@pytest.mark.skipif(LANDLOCK < 4, reason="TCP confinement needs Landlock ABI >= 4")
def test_network_is_denied_unless_allowed():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
            "    print('connected')\nexcept OSError as e:\n    print('refused', type(e).__name__)")
    try:
        assert PythonSandbox().run(code).stdout == "refused PermissionError\n"
        assert PythonSandbox(allow_network=True).run(code).stdout == "connected\n"
    finally:
        server.close()


def test_bad_code_arguments_and_config():
    assert PythonSandbox(max_code_chars=10).run("print('a very long line')").error.startswith("the code is over")
    assert "NUL" in PythonSandbox().run("print(1)\x00").error
    with pytest.raises(TypeError):
        PythonSandbox().run(b"print(1)")
    for bad in ({"timeout": 0}, {"memory_mb": 0}, {"cpu_seconds": 0}, {"run_as": "root"}, {"isolation": "vm"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PythonSandbox(**bad)


def test_python_tool_runs_code_blocks_through_the_registry():
    reg = ToolRegistry([python_tool(PythonSandbox(timeout=5))], formats=("python",))
    msgs = reg("Let me check:\n```python\nprint(sum(range(10)))\n```\nand\n```python\n1/0\n```")
    assert [m.name for m in msgs] == ["python", "python"]
    assert msgs[0].content == "45"
    assert "ZeroDivisionError" in msgs[1].content and msgs[1].content.endswith("[exit code 1]")


def test_concurrent_runs_do_not_interfere(box):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: box.run(f"import os\nprint({i}, os.getuid())"), range(4)))
    assert [r.stdout.split()[0] for r in results] == ["0", "1", "2", "3"]
    if ROOT:  # a fresh uid per run: their process limits and clean-up cannot touch each other
        assert len({r.stdout.split()[1] for r in results}) == 4 and "0" not in {r.stdout.split()[1] for r in results}


def test_result_text_for_signals():
    assert SandboxResult("", "", -9).to_text() == "[terminated by signal SIGKILL (killed)]"
    assert SandboxResult("out\n", "", 0).to_text() == "out"


@pytest.mark.filterwarnings("ignore:PythonSandbox")  # process isolation may fall back to a system python3
@pytest.mark.parametrize("isolation", ["namespaces", "process"])
def test_both_isolations_run_code_and_pass_a_secret(isolation):
    box = PythonSandbox(timeout=5, isolation=isolation)
    code = "import os\nprint(os.listdir('.'))\nos.write(4, os.read(3, 64)[::-1])\nos.close(3)"
    r = box.run(code, secret=b"nonce-123")
    assert r.ok and r.stdout == "[]\n" and r.report == b"321-ecnon", r.to_text()
    assert box.run("import os\nos.read(3, 1)").exit_code == 1  # without a secret there is no fd 3
    with pytest.raises(ValueError, match="secret"):
        box.run("pass", secret="text")


def test_a_broken_interpreter_is_an_error_result_not_an_exception():
    r = PythonSandbox(timeout=5, python="/nonexistent/python3", run_as=None).run("print(1)")
    assert r.error is not None and "/nonexistent/python3" in r.error and not r.ok
    assert "[sandbox error:" in r.to_text()
