"""How long the caller takes to read one sandboxed program's report, for reports built to be slow to read.

    uv run python benchmarks/report_decode.py                 # every attack, at the 4 MiB report limit
    uv run python benchmarks/report_decode.py --scale 0.1     # each attack at a tenth of its size

A CodeEnv run reports its results as lines of flat JSON (env/code.py: `parse_report`), decoded into
fresh objects (env/code_codec.py). Each report below is what a hostile program can write on its
own report fd: the caller parses it with no sandbox in between, holding the GIL. Printed per
attack: seconds to parse, the report's size, what the caller still holds after three parses
(tracemalloc, after gc), and what the first result decoded to. The bound stated in
docs/sandbox.md is the largest of these.
"""

import argparse
import gc
import json
import time
import tracemalloc

from SimpleTorchLLMRL.env.code import parse_report

NONCE = b"0123456789abcdef"
M61 = (1 << 61) - 1  # ints that differ by this hash alike


def line(*items) -> bytes:
    return json.dumps(list(items)).encode() + b"\n"


def attacks(scale: float) -> dict[str, bytes]:
    n = max(1, int(100_000 * scale))
    bits = max(64, int(7_000_000 * scale))
    quotes = max(1, int(150_000 * scale))
    fields = [f"f{i}" for i in range(n)]
    big = (1 << bits) - 1
    return {
        "0.29 MB line of escaped quotes": b'[0, "ok", "s", "' + b'\\"' * quotes + b"\n",
        "set of ints that hash alike": line(0, "ok", "S", n, *[t for k in range(1, n + 1) for t in ("i", hex(k * M61))]),
        "list of ints that hash alike": line(0, "ok", "l", n, *[t for k in range(1, n + 1) for t in ("i", hex(k * M61))]),
        "dict keys that hash alike": line(0, "ok", "d", n, *[t for k in range(1, n + 1) for t in ("i", hex(k * M61), "N")]),
        "Fraction of two 7-million-bit ints": line(0, "ok", "q", hex(big), hex(big - 2)),
        "int of 7 million bits": line(0, "ok", "i", hex(big)),
        "namedtuple of 100,000 fields": line(0, "ok", "n", "T", n, *fields, *["N"] * n),
        "300 namedtuple classes": b"".join(line(k, "ok", "n", f"T{k}", 3, "a", "b", "c", "N", "N", "N")
                                           for k in range(max(1, int(300 * min(1.0, scale * 10))))),
        "1-tuples 99 deep": line(0, "ok", "l", n // 20, *(["t", 1] * 99 + ["N"]) * (n // 20)),
        "empty lists (most containers a byte)": line(0, "ok", "l", 5 * n, *["l", 0] * (5 * n)),
        "Nones (most values a byte)": line(0, "ok", "l", 8 * n, *["N"] * (8 * n)),
    }


def measure(report: bytes, repeats: int = 3) -> tuple[float, int, str]:
    """(slowest of `repeats` parses in seconds, bytes still held after three more parses, the first result)."""
    data = NONCE + b"\n" + report
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        results, problem = parse_report(data, NONCE)
        seconds.append(time.perf_counter() - start)
    first = next(iter(results.values()), None)
    what = problem or ("no result" if first is None else f"{first[0]}: {first[1] if first[0] != 'ok' else type(first[1]).__name__}"[:70])
    del results, first
    gc.collect()
    tracemalloc.start()  # apart from the timing: tracing slows allocation several times
    for _ in range(3):
        parse_report(data, NONCE)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return max(seconds), held, what


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for name, report in attacks(args.scale).items():
        seconds, held, what = measure(report)
        rows.append({"attack": name, "seconds": round(seconds, 3), "report_mb": round(len(report) / 2**20, 2),
                     "held_mb": round(held / 2**20, 2), "result": what})
        print(f"{name:38s} {seconds:8.3f} s  {len(report) / 2**20:6.2f} MB  held {held / 2**20:6.2f} MB  {what}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
