"""Per-run overhead of the python sandbox: median wall time of `run("pass")` over 20 runs (after one warm-up).

    uv run python benchmarks/sandbox_overhead.py                          # the defaults (namespaces here)
    uv run python benchmarks/sandbox_overhead.py --isolation process
    uv run python benchmarks/sandbox_overhead.py --python /usr/bin/python3

It includes starting the interpreter, which dominates: compare with
`python -I -c pass` on the same interpreter (printed too).
"""

import argparse
import statistics
import subprocess
import time

from SimpleTorchLLMRL.tools.sandbox import PythonSandbox


def median_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "process"))
    parser.add_argument("--python", default=None)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    box = PythonSandbox(timeout=10, isolation=args.isolation, python=args.python)
    python = box.interpreter()

    def run():
        r = box.run("pass")
        assert r.ok, r.to_text()

    sandboxed = median_ms(run, args.runs)
    bare = median_ms(lambda: subprocess.run([python, "-I", "-c", "pass"], check=True), args.runs)
    print(f"isolation={box._isolation()} python={python}")
    print(f"run('pass'): median {sandboxed:.1f} ms over {args.runs} runs; bare `{python} -I -c pass`: {bare:.1f} ms")


if __name__ == "__main__":
    main()
