"""The docs cannot rot: every ```python block in README.md and docs/*.md runs, every link resolves.

Each markdown file's python blocks run in order, in one fresh namespace, in a
subprocess (cwd: a temporary directory; WANDB_MODE=disabled, HF_HUB_OFFLINE=1),
so a page reads top to bottom like a script. A failure names the file and the
block number. Three kinds of block, chosen by the fence's info string:

    ```python                      runs
    ```python excerpt=main.py      a quote of a repository file: each non-blank line (stripped) but `...`
                                   must be one of that file's lines, so the quote follows the code it shows
    ```python no-run               shown, not run; its first line must say why (`# not run: ...`)

Commands in ```bash blocks and in the examples' docstrings are checked without
running them (they are long): the script exists and takes every `--flag` given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README, *PAGES]
FENCE = re.compile(r"^(\s*)```(.*)$")
NOT_RUN_REASON = re.compile(r"^# not run: \S")


def blocks(path: Path) -> list[tuple[str, int, str]]:
    """(info string, first line number, code) of each fenced block, in order."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, info, start = m.group(1), m.group(2).strip(), i + 1
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        assert i < len(lines), f"{path.name}:{start}: unclosed code fence"
        out.append((info, start, "\n".join(body) + "\n"))
        i += 1
    return out


def python_blocks(path: Path) -> list[tuple[int, str, int, str]]:
    """(number among the file's python blocks, info, line, code)."""
    found = [(info, line, code) for info, line, code in blocks(path) if info.split()[:1] == ["python"]]
    return [(n, info, line, code) for n, (info, line, code) in enumerate(found, 1)]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------- running the snippets

RUNNER = textwrap.dedent("""
    import json, sys, time, traceback
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for number, line, code in blocks:
        t = time.time()
        try:
            exec(compile(code, f"{sys.argv[2]} python block {number} (line {line})", "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"DOCS FAILED: {sys.argv[2]} python block {number} (line {line})", file=sys.stderr)
            sys.exit(1)
        print(f"DOCS block {number} (line {line}): {time.time() - t:.1f} s", file=sys.stderr)
""")


def run_page(path: Path, tmp: Path) -> tuple[subprocess.CompletedProcess, float]:
    import json

    runnable = [(n, line, code) for n, info, line, code in python_blocks(path) if info == "python"]
    work = tmp / path.stem
    work.mkdir(parents=True, exist_ok=True)
    (work / "blocks.json").write_text(json.dumps(runnable))
    (work / "runner.py").write_text(RUNNER)
    env = dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t = time.time()
    proc = subprocess.run([sys.executable, "runner.py", "blocks.json", rel(path)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, time.time() - t


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """Every page's run, two pages at a time (the blocks of one page stay in order)."""
    tmp = tmp_path_factory.mktemp("docs")
    pages = [p for p in MARKDOWN if any(info == "python" for _, info, _, _ in python_blocks(p))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {p: pool.submit(run_page, p, tmp) for p in pages}
        return {p: f.result() for p, f in futures.items()}


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_python_snippets_run(path, page_runs):
    if path not in page_runs:
        pytest.skip(f"{rel(path)} has no python block to run")
    proc, seconds = page_runs[path]
    assert proc.returncode == 0, (
        f"{rel(path)}: a python block failed ({seconds:.0f} s)\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_blocks_not_run_are_marked_and_excerpts_match(path):
    for n, info, line, code in python_blocks(path):
        where = f"{rel(path)} python block {n} (line {line})"
        if info == "python":
            continue
        if info == "python no-run":
            assert NOT_RUN_REASON.match(code), f"{where}: a no-run block starts with '# not run: <why>'"
            continue
        m = re.fullmatch(r"python excerpt=(\S+)", info)
        assert m, f"{where}: unknown info string {info!r} (python | python no-run | python excerpt=PATH)"
        source = ROOT / m.group(1)
        assert source.is_file(), f"{where}: {m.group(1)} does not exist"
        have = {s.strip() for s in source.read_text().splitlines()}
        missing = [s.strip() for s in code.splitlines() if s.strip() not in have | {"", "..."}]
        assert not missing, f"{where}: lines not in {m.group(1)} (update the quote): {missing}"


# ----------------------------------------------------------------------------- shape and links


def test_readme_is_a_map():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines; it is a map (<= 300): move the detail to docs/"
    assert len(PAGES) >= 5, f"docs/ has {len(PAGES)} pages, expected >= 5"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file without its fenced code blocks (a fence's body may itself contain backticks)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if inside:
            inside = line.strip() != "```"
        elif FENCE.match(line):
            inside = True
        else:
            out.append(line)
    return "\n".join(out)


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose(path), flags=re.M)}


def links(path: Path) -> list[str]:
    return LINK.findall(re.sub(r"`[^`\n]*`", "", prose(path)))


# Pages other engineers are writing on their branches: linked from the README's map before they land.
PENDING = {ROOT / "docs" / "rewards.md", ROOT / "docs" / "sandbox.md"}


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_relative_links_resolve(path):
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() and dest not in PENDING:
            broken.append(target)
        elif anchor and dest.exists() and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{rel(path)}: broken links {broken}"


# ----------------------------------------------------------------------------- commands, checked statically

COMMAND = re.compile(r"python\s+(?:-m\s+torch\.distributed\.run\s+)?((?:examples|benchmarks|tests)/\w+\.py|main\.py)"
                     r"([^\n#]*)")
FLAG_SOURCES = {"main.py": ["SimpleTorchLLMRL/recipes/calculator/cli.py"]}


def commands(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for m in COMMAND.finditer(text.replace("\\\n", " ")):
        out.append((m.group(1), re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2))))
    for m in re.finditer(r"torchrun\s[^\n#]*?((?:examples)/\w+\.py)([^\n#]*)", text.replace("\\\n", " ")):
        out.append((m.group(1), re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2))))
    return out


def command_texts() -> list[tuple[str, str]]:
    texts = []
    for path in MARKDOWN:
        for info, line, code in blocks(path):
            if info in ("bash", "sh", "text", "console", ""):
                texts.append((f"{rel(path)}:{line}", code))
        texts.append((rel(path), "\n".join(re.findall(r"`([^`\n]*)`", prose(path)))))
    for script in sorted((ROOT / "examples").glob("*.py")):
        doc = re.match(r'\s*(?:#.*\n)*\s*"""(.*?)"""', script.read_text(), flags=re.S)
        if doc:
            texts.append((rel(script) + " docstring", doc.group(1)))
    return texts


def test_documented_commands_name_real_scripts_and_flags():
    problems, seen = [], 0
    for where, text in command_texts():
        for script, flags in commands(text):
            seen += 1
            path = ROOT / script
            if not path.is_file():
                problems.append(f"{where}: {script} does not exist")
                continue
            source = path.read_text() + "".join((ROOT / s).read_text() for s in FLAG_SOURCES.get(script, []))
            problems += [f"{where}: {script} has no flag {f}" for f in flags if f'"{f}"' not in source]
    assert seen >= 10, f"only {seen} commands found: is the pattern still right?"
    assert not problems, "\n".join(problems)
