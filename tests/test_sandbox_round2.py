"""Sandbox, second round of attacks: what a run can do to the file that carries its code.

Before, the code reached the run as an unnamed temp file on the host's disk, open read-write on fd 0:
a run could write to it and grow it outside its working directory (bounded only by file_size_mb)."""

from SimpleTorchLLMRL.tools.sandbox import PythonSandbox

PROBE = r'''
import os
print("link", os.readlink("/proc/self/fd/0"))
for how in ("write", "reopen", "truncate"):
    try:
        if how == "write":
            os.write(0, b"x" * 4096)
        elif how == "reopen":
            fd = os.open("/proc/self/fd/0", os.O_RDWR)
            os.write(fd, b"x")
        else:
            os.ftruncate(0, 16 << 20)
        print(how, "succeeded")
    except OSError as e:
        print(how, "refused", e.errno)
'''


def test_the_code_arrives_read_only_and_not_on_the_host_disk():
    result = PythonSandbox(timeout=10).run(PROBE)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["link"].startswith("/memfd:"), result.stdout  # in memory, sealed
    for how in ("write", "reopen", "truncate"):
        assert lines[how].startswith("refused"), result.stdout


def test_code_still_runs_from_the_sealed_file():
    box = PythonSandbox(timeout=10)
    big = "x = 0\n" + "x += 1\n" * 12000 + "print(x)\n"  # 84 kB: more than a pipe buffer holds
    assert box.run(big).stdout.strip() == "12000"
    assert box.run("print('é' + chr(0x1F600))").stdout.strip() == "é" + chr(0x1F600)
