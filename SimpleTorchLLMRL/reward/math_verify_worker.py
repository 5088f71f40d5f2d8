r"""The child process behind `math_verify_pool`: math-verify's verdicts, one JSON line per question.

Run as a script (`python -P this_file.py`; standard library and math-verify only). First line written:
{"ready": true}; then per question, on its own main thread (so math-verify's SIGALRM timeouts work):

    parent -> child   {"gold": "...", "pred": "...", "timeout": 2.0}
    child  -> parent  {"verdict": true | false | null}      (null: math-verify could not read an answer)
"""

import json
import sys


def verdict(math_verify, gold: str, pred: str, timeout: float) -> bool | None:
    seconds = max(1, round(timeout))  # math-verify's alarms take whole seconds
    try:
        g = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=seconds)
        p = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=seconds)
        if not g or not p:
            return None
        return bool(math_verify.verify(g, p, timeout_seconds=seconds))
    except Exception:  # assorted parser errors
        return None
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if type(e).__name__ == "TimeoutException":
            return False
        raise


def main() -> None:
    import math_verify

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        question = json.loads(line)
        answer = verdict(math_verify, question["gold"], question["pred"], float(question["timeout"]))
        out.write(json.dumps({"verdict": answer}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
