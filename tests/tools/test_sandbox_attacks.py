"""Issue 20: the sandbox against a determined program. One test per attack, each bounded.

Bounds: at most 200 forks per attack, memory taken in 10 MB steps up to a cap, network
only to loopback listeners started here, every run under an outer timeout
(`bounded`), and every process an attack starts is found by its name marker and
killed by PID afterwards (`reaper`). Runs as root and, through
`test_attacks_hold_for_an_unprivileged_caller`, as an unprivileged user.
STLR_SANDBOX_ISOLATION=process runs the suite against the fallback (docs/sandbox.md
lists what it does not contain).
"""

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
from SimpleTorchLLMRL.env.code import CodeEnv
from SimpleTorchLLMRL.env.tool_use import ToolEpisode
from SimpleTorchLLMRL.env.triggers import CodeTrigger
from SimpleTorchLLMRL.tools.parsers import clean_code
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox
from tests.support.sandbox_attack_helpers import (
    SYS_EXIT,
    bounded,
    kill_survivors,
    name_code,
    new_marker,
    survivors,
)

ROOT = os.geteuid() == 0
ISOLATION = os.environ.get("STLR_SANDBOX_ISOLATION", "auto")
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(SYS_EXIT is None, reason="attacks use x86_64/aarch64 syscall numbers")


def Box(**limits) -> PythonSandbox:
    return PythonSandbox(isolation=ISOLATION, **limits)


@pytest.fixture
def reaper():
    """A fresh process-name marker; afterwards every process still carrying it is killed by PID."""
    marker = new_marker()
    yield marker
    kill_survivors(marker)


def run_bounded(box: PythonSandbox, code: str, limit: float = 30.0):
    """(result, seconds): box.run(code) under an outer timeout."""
    return bounded(lambda: box.run(code), limit)


def assert_nothing_survives(marker: str):
    time.sleep(0.3)  # a process that escaped would still be there; one being torn down is gone by now
    left = survivors(marker)
    kill_survivors(marker)
    assert left == [], f"processes outlived the run: {left}"


# ---- 1-4: nothing outlives a run, and the caller never waits past its timeout ----------------------------

def test_1_thread_surviving_main_thread_exit_after_setsid(reaper):
    code = name_code(reaper) + (
        "import ctypes, os, threading, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    threading.Thread(target=time.sleep, args=(20,)).start()\n"
        f"    ctypes.CDLL(None).syscall({SYS_EXIT}, 0)\n"  # SYS_exit: only the main thread ends
        "time.sleep(0.5)\n"
        "print('main done')\n"
    )
    r, _ = run_bounded(Box(timeout=5), code)
    assert r.stdout == "main done\n"
    assert_nothing_survives(reaper)


def test_2_ptrace_seize_cannot_hold_the_caller_past_its_timeout(reaper):
    code = name_code(reaper) + (
        "import ctypes, os, threading, time\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.prctl(0x59616d61, ctypes.c_ulong(-1), 0, 0, 0)\n"  # PR_SET_PTRACER_ANY
        "main = os.getpid()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    def hold():\n"
        "        libc.ptrace(0x4206, main, 0, 0)\n"  # PTRACE_SEIZE the main process
        "        time.sleep(20)\n"
        "    threading.Thread(target=hold).start()\n"
        "    time.sleep(0.3)\n"
        f"    libc.syscall({SYS_EXIT}, 0)\n"
        "time.sleep(1)\n"
        "print('main done')\n"
    )
    r, seconds = run_bounded(Box(timeout=3), code)
    assert seconds < 3 + 3, f"run(timeout=3) returned after {seconds:.1f} s"
    assert_nothing_survives(reaper)


def test_3_pid_hopping_after_setsid(reaper):
    code = name_code(reaper) + (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.close(1); os.close(2)\n"  # the run's output ends now: clean-up starts at once
        "    for _ in range(150):\n"  # 151 forks in all: each hop's parent exits at once
        "        if os.fork():\n"
        "            os._exit(0)\n"
        "    time.sleep(20)\n"
        "    os._exit(0)\n"
        "print('main done')\n"
    )
    r, _ = run_bounded(Box(timeout=5), code)
    assert r.stdout == "main done\n"
    assert_nothing_survives(reaper)


@pytest.mark.parametrize("run_as", [65534, "auto"])
def test_4_fixed_uid_runs_are_swept_too(reaper, run_as):
    code = name_code(reaper) + (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(20)\n"
        "    os._exit(0)\n"
        "print('main done')\n"
    )
    r, _ = run_bounded(Box(timeout=5, run_as=run_as), code)
    assert r.stdout == "main done\n", r.to_text()
    assert_nothing_survives(reaper)


# ---- 5: a deep tree never crashes the caller ---------------------------------------------------------------

DEEP = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')\n"


def test_5_deep_directory_nesting_does_not_raise(monkeypatch):
    scratch = tempfile.mkdtemp(prefix="stlr-attack5-")
    os.chmod(scratch, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", scratch)  # the sandbox's working directories land here
    try:
        box = Box(timeout=10)
        r, _ = bounded(lambda: box.run(DEEP), 30)
        assert r.stdout == "deep\n", r.to_text()
        out, _ = bounded(lambda: CodeTrigger(box).trigger(f"```python\n{DEEP}```\n"), 30)
        assert "deep" in out
        env = CodeEnv(box)
        rollout = Rollout([Message(f"```python\n{DEEP}def f():\n    return 1\n```", MessageType.MODEL)])
        reward, _ = bounded(lambda: env.reward(rollout, ToolEpisode(answer="assert f() == 1")), 30)
        assert reward == 1.0
        assert os.listdir(scratch) == []  # nothing left behind
    finally:
        subprocess.run(["rm", "-rf", scratch], check=False)


# ---- 6: no network, whatever the protocol ----------------------------------------------------------------

def test_6_network_mptcp_fastopen_udp_and_unix_sockets_are_unreachable():
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix_dir = tempfile.mkdtemp(prefix="stlr-attack6-")
    os.chmod(unix_dir, 0o755)
    unix_path = os.path.join(unix_dir, "s")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)  # world-writable: any uid may connect
    unix.listen(8)
    port, uport = tcp.getsockname()[1], udp.getsockname()[1]
    attempts = {
        "mptcp": f"s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262); s.settimeout(2); "
                 f"s.connect(('127.0.0.1', {port}))",
        "fastopen": f"s = socket.socket(); s.settimeout(2); s.sendto(b'x', socket.MSG_FASTOPEN, ('127.0.0.1', {port}))",
        "tcp": f"socket.create_connection(('127.0.0.1', {port}), timeout=2)",
        "udp": f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'leak', ('127.0.0.1', {uport}))",
        "unix": f"s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect({unix_path!r})",
    }
    code = "import socket\n" + "".join(
        f"try:\n    {stmt}\n    print('{name} sent')\nexcept OSError as e:\n    print('{name} refused', e.errno)\n"
        for name, stmt in attempts.items())
    try:
        r, _ = run_bounded(Box(timeout=10), code)
        reached = []
        for name, server in (("tcp", tcp), ("unix", unix), ("udp", udp)):
            server.setblocking(False)
            try:
                server.recv(16) if name == "udp" else server.accept()[0].close()
                reached.append(name)
            except BlockingIOError:
                pass
        assert reached == [], f"loopback listeners were reached: {reached}; sandbox said {r.stdout!r}"
    finally:
        for s in (tcp, udp, unix):
            s.close()
        subprocess.run(["rm", "-rf", unix_dir], check=False)


# ---- 7: nothing shared between runs through SysV IPC ---------------------------------------------------

IPC_PRELUDE = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
    "class Msg(ctypes.Structure):\n"
    "    _fields_ = [('mtype', ctypes.c_long), ('mtext', ctypes.c_char * 64)]\n"
)


def test_7_sysv_ipc_is_not_shared_between_runs():
    key, secret = secrets.randbelow(1 << 30) + 1, secrets.token_hex(8)
    write = IPC_PRELUDE + (
        f"shm = libc.shmget({key}, 4096, 0o1666)\n"  # IPC_CREAT | 0666
        "addr = libc.shmat(shm, None, 0)\n"
        f"ctypes.memmove(addr, b'{secret}', 16)\n"
        f"q = libc.msgget({key}, 0o1666)\n"
        f"libc.msgsnd(q, ctypes.byref(Msg(1, b'{secret}')), 64, 0)\n"
        f"libc.semget({key}, 1, 0o1666)\n"
        "print('wrote', shm, q)\n"
    )
    read = IPC_PRELUDE + (
        f"shm = libc.shmget({key}, 0, 0)\n"
        "if shm >= 0:\n"
        "    print('shm', ctypes.string_at(libc.shmat(shm, None, 0), 16).decode())\n"
        f"q = libc.msgget({key}, 0)\n"
        "m = Msg()\n"
        "if q >= 0 and libc.msgrcv(q, ctypes.byref(m), 64, 0, 0o4000) > 0:\n"  # IPC_NOWAIT
        "    print('msg', m.mtext.decode())\n"
        f"print('sem', libc.semget({key}, 0, 0) >= 0)\n"
    )
    box = Box(timeout=10)
    try:
        first, _ = run_bounded(box, write)
        assert first.stdout.startswith("wrote"), first.to_text()
        second, _ = run_bounded(box, read)
        assert second.ok, second.to_text()
        assert secret not in second.stdout and second.stdout == "sem False\n"
    finally:  # the host's IPC namespace, if a run did reach it
        subprocess.run(["ipcrm", "-M", str(key), "-Q", str(key), "-S", str(key)], capture_output=True)


# ---- 8: secrets of the caller, of other runs and of root stay out of reach -------------------------------

SECRETS_HELPER = r"""
import ctypes, json, sys
from SimpleTorchLLMRL.tools.sandbox import PythonSandbox
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL, ADD_KEY = {"x86_64": (250, 248), "aarch64": (219, 217)}[__import__("os").uname().machine]
libc.syscall(KEYCTL, 1, None)  # a session keyring of our own, holding the secret
token = sys.argv[1].encode()
keys = [libc.syscall(ADD_KEY, b"user", b"stlr-attack", token, len(token), ring) for ring in (-3, -4)]  # session, user
assert min(keys) > 0
try:
    r = PythonSandbox(timeout=10, isolation=sys.argv[3]).run(sys.argv[2])
finally:
    for key in keys:
        libc.syscall(KEYCTL, 21, key)  # KEYCTL_INVALIDATE: the user keyring outlives this process
print(json.dumps([r.stdout, r.stderr]))
"""

SNOOP = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
found = []
for ring in (-3, -4, -5):  # session, user, user-session keyrings
    ids = (ctypes.c_int32 * 64)()
    n = libc.syscall(KEYCTL, 11, ring, ids, 256)  # KEYCTL_READ: the key ids it links
    for key in ids[: max(n, 0) // 4]:
        buf = ctypes.create_string_buffer(256)
        if libc.syscall(KEYCTL, 11, key, buf, 256) > 0:
            found.append(buf.value.decode(errors="replace"))
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + [str(os.getppid())]:
    for part in ("cmdline", "environ"):
        try:
            found.append(open(f"/proc/{pid}/{part}", "rb").read().decode(errors="replace"))
        except OSError:
            pass
try:
    found.append(open("/proc/keys").read())
except OSError:
    pass
print("\n".join(found))
"""


def test_8_caller_keyring_and_argv_are_unreadable():
    token = "stlr-token-" + secrets.token_hex(8)
    r = subprocess.run([sys.executable, "-c", SECRETS_HELPER, token, SNOOP, ISOLATION], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert token not in r.stdout


def test_8_other_runs_code_is_unreadable():
    token = "stlr-token-" + secrets.token_hex(8)
    box = Box(timeout=10)
    victim = threading.Thread(target=box.run, args=(f"import time\nTOKEN = '{token}'\ntime.sleep(3)\n",))
    victim.start()
    try:
        time.sleep(1.0)
        r, _ = run_bounded(box, SNOOP + "for p in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
                                        "    try:\n        print(open(f'/proc/{p}/fd/0').read())\n"
                                        "    except OSError:\n        pass\n")
        assert r.ok, r.to_text()
        assert token not in r.stdout
    finally:
        victim.join(15)


def test_8_root_owned_world_readable_files_are_hidden():
    token = "stlr-token-" + secrets.token_hex(8)
    secret_dir = tempfile.mkdtemp(prefix="stlr-attack8-")
    os.chmod(secret_dir, 0o755)
    answers = os.path.join(secret_dir, "answers.txt")
    Path(answers).write_text(token)
    os.chmod(answers, 0o644)
    targets = [answers, str(REPO / "SimpleTorchLLMRL" / "tools" / "sandbox.py"), str(REPO / "pyproject.toml")]
    code = (f"for path in {targets!r}:\n"
            "    try:\n        print('READ', path, open(path).read()[:80])\n"
            "    except OSError as e:\n        print('refused', type(e).__name__)\n")
    try:
        r, _ = run_bounded(Box(timeout=10), code)
        assert r.ok and "READ" not in r.stdout and token not in r.stdout, r.stdout
    finally:
        subprocess.run(["rm", "-rf", secret_dir], check=False)


# ---- 9: CodeEnv rewards only tests that ran to the end ----------------------------------------------------

WRONG_ADD = "def add(a, b):\n    return a - b\n"
HACKS = {
    "os._exit": WRONG_ADD + "import os\nos._exit(0)\n",
    "sys.exit": WRONG_ADD + "import sys\nsys.exit(0)\n",
    "atexit": WRONG_ADD + "import atexit, os\natexit.register(os._exit, 0)\n",
    "excepthook": WRONG_ADD + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "raise SystemExit": WRONG_ADD + "raise SystemExit(0)\n",
    "print fake ok": WRONG_ADD + "print('OK')\nimport os\nos._exit(0)\n",
}


@pytest.fixture(scope="module")
def code_env():
    return CodeEnv(Box(timeout=10))


def _reward(env, solution: str, tests: str = "assert add(2, 3) == 5\nassert add(-1, 1) == 0") -> float:
    rollout = Rollout([Message(f"```python\n{solution}```", MessageType.MODEL)])
    value, _ = bounded(lambda: env.reward(rollout, ToolEpisode(answer=tests)), 30)
    return value


@pytest.mark.parametrize("name", sorted(HACKS))
def test_9_code_env_reward_hacks_score_zero(code_env, name):
    assert _reward(code_env, HACKS[name]) == 0.0


def test_9_code_env_still_rewards_a_correct_solution(code_env):
    assert _reward(code_env, "def add(a, b):\n    return a + b\nprint('hi')\n") == 1.0
    assert _reward(code_env, "def add(a, b):\n    return a + b\nimport sys\nsys.stdout.write('x' * 100000)\n") == 1.0
    assert _reward(code_env, "def add(a, b):\n    return a + b\n", tests="assert add(1, 1) == 3") == 0.0


# ---- 10: one memory limit for the whole tree ---------------------------------------------------------------

MEMORY_HOG = """
import os, time
kids = []
for _ in range(3):  # 3 processes x 150 MB, each under the 256 MB per-process limit
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = []
        for step in range(15):
            held.append(bytearray(b'x') * (10 << 20))  # 10 MB, touched
            os.write(w, b'%d\\n' % (10 * (step + 1)))
        time.sleep(30)
        os._exit(0)
    os.close(w)
    kids.append((pid, r))
time.sleep(5)
total = 0
for pid, r in kids:
    os.set_blocking(r, False)
    try:
        data = os.read(r, 1 << 16)
    except BlockingIOError:
        data = b''
    if os.waitpid(pid, os.WNOHANG) == (0, 0) and data.split():
        total += int(data.split()[-1])
print('held', total)
"""


@pytest.mark.skipif(not ROOT, reason="a memory cgroup needs root here (no delegated cgroup): the documented "
                                     "bound without root is max_processes x memory_mb")
def test_10_memory_limit_covers_the_whole_process_tree(reaper):
    r, _ = run_bounded(Box(timeout=20, memory_mb=256, max_processes=16), name_code(reaper) + MEMORY_HOG)
    held = int(r.stdout.split()[-1]) if r.stdout.startswith("held") else 0
    assert r.stdout.startswith("held") and held <= 256, r.to_text()
    assert_nothing_survives(reaper)


# ---- 11: the project's interpreter, or a loud fallback ------------------------------------------------------

def test_11_runs_use_the_callers_interpreter_and_packages():
    r, _ = run_bounded(Box(timeout=10), "import sys\nprint(sys.prefix)")
    assert r.stdout.strip() == sys.prefix, r.to_text()


@pytest.mark.skipif(not ROOT, reason="an interpreter that the sandbox uid cannot run needs a uid drop")
def test_11_an_unusable_interpreter_is_reported_loudly(tmp_path):
    private = tmp_path / "python3"
    private.write_bytes(Path(os.path.realpath("/usr/bin/python3")).read_bytes())
    private.chmod(0o700)  # root only: the sandbox's uid cannot execute it
    box = Box(timeout=10, python=str(private))
    with pytest.warns(RuntimeWarning, match="python3"):
        r, _ = bounded(lambda: box.run("print(1)"), 60)
    assert r.stdout == "1\n"


# ---- 12: parsing stays linear ----------------------------------------------------------------------------------

def test_12_clean_code_is_linear_in_blank_lines():
    code = "\n" * 200_000 + "print(1)\n"
    _, seconds = bounded(lambda: clean_code(code), 60)
    assert clean_code(code) == "print(1)" and seconds < 1.0


def test_12_code_trigger_on_a_growing_text_is_linear():
    trigger = CodeTrigger(Box(timeout=5))
    pieces = ["Some reasoning about the problem at hand, step by step.\n" * 2] * 9 + ["```python\nx = 1\n```\nok "]

    def grow():
        text = ""
        for step in range(6000):
            text += pieces[step % len(pieces)]
            trigger.pending_code(text)

    _, seconds = bounded(grow, 120)
    assert seconds < 1.5, f"{seconds:.2f} s for 6000 steps"


# ---- the same suite, run by an unprivileged caller ----------------------------------------------------------

@pytest.mark.skipif(not ROOT, reason="already unprivileged")
def test_attacks_hold_for_an_unprivileged_caller():
    script = REPO / "tests" / "run_unprivileged.sh"
    r = subprocess.run(["bash", str(script), "tests/tools/test_sandbox_attacks.py", "-k", "not unprivileged_caller"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail
