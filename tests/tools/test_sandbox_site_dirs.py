"""The sandbox sees the caller's packages however the caller was started (issue 43, item 6).

`uv run --with X` runs an overlay venv: its own site-packages holds only a `.pth` file that adds X's
environment and the project's venv. Before (8c45457) only the overlay and the interpreter were bound into
the run, so a correct numpy solution scored 0 ("did not load: ModuleNotFoundError"), silently. Here the
overlay is built as uv builds it (pyvenv.cfg, bin/python, a `.pth` adding this venv's site-packages) and
the reward is taken by a process started with its python, as under `uv run --with`.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

import numpy
import pytest

from SimpleTorchLLMRL.tools import sandbox_run

NUMPY_SITE = os.path.dirname(os.path.dirname(os.path.abspath(numpy.__file__)))


@pytest.fixture
def overlay():
    """An overlay venv in a world-readable folder (the run's uid must be able to start its python)."""
    root = tempfile.mkdtemp(prefix="stlr-overlay-")
    os.chmod(root, 0o755)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    site = os.path.join(root, os.path.relpath(sysconfig.get_path("purelib"), sys.prefix))
    os.makedirs(site)
    os.makedirs(os.path.join(root, "bin"))
    os.symlink(base, os.path.join(root, "bin", "python"))
    with open(os.path.join(root, "pyvenv.cfg"), "w") as f:
        f.write(f"home = {os.path.dirname(base)}\ninclude-system-site-packages = false\n"
                f"version_info = {'.'.join(map(str, sys.version_info[:3]))}\nextends-environment = {sys.prefix}\n")
    with open(os.path.join(site, "_uv_ephemeral_overlay.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({NUMPY_SITE!r})\n")
    for path, dirs, files in os.walk(root):
        for name in dirs + files:
            if not os.path.islink(os.path.join(path, name)):
                os.chmod(os.path.join(path, name), 0o755)
    yield os.path.join(root, "bin", "python")
    shutil.rmtree(root, ignore_errors=True)


SCORE = textwrap.dedent("""
    import sys
    from SimpleTorchLLMRL.chat.message import Message, MessageType, Rollout
    from SimpleTorchLLMRL.env.code import CodeEnv
    from SimpleTorchLLMRL.env.tool_use import ToolEpisode
    from SimpleTorchLLMRL.tools.sandbox import PythonSandbox
    from SimpleTorchLLMRL.tools.sandbox_run import exposed_paths

    assert "stlr-overlay-" in sys.executable, sys.executable
    code = "import numpy as np\\ndef total(xs):\\n    return int(np.sum(np.array(xs)))\\n"
    rollout = Rollout([Message("```python\\n" + code + "```", MessageType.MODEL)])
    env = CodeEnv(PythonSandbox(timeout=30, isolation="namespaces"), workers=1)
    v = env.verdict(rollout, ToolEpisode(answer=["assert total([1, 2, 3]) == 6", "assert total([]) == 0"]))
    print("REWARD", v.reward, v.reason, exposed_paths(sys.executable))
""")


def test_a_numpy_solution_scores_under_an_overlay_venv(overlay):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "UV_"))}
    p = subprocess.run([overlay, "-c", SCORE], capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("REWARD"))
    if "namespaces" in line and "unsupported" in line:
        pytest.skip("namespaces are not available here")
    assert line.startswith("REWARD 1.0 None"), line
    assert NUMPY_SITE in line  # bound into the run: the caller's site directory, found through the overlay's .pth


def test_site_dirs_are_only_site_directories(monkeypatch, tmp_path):
    data = tmp_path / "project"  # an editable install's folder, or the script's: may hold a data set
    extra = tmp_path / "extra" / "site-packages"
    data.mkdir()
    extra.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(data), "", str(extra), *sys.path])
    found = sandbox_run.site_dirs()
    assert str(extra) in found and str(data) not in found and os.getcwd() not in found
    assert str(extra) in sandbox_run.exposed_paths(sys.executable)
    assert str(extra) not in sandbox_run.exposed_paths("/usr/bin/python3")  # another interpreter: only its own
