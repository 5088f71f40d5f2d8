"""The losses examples at their smoke sizes: examples/distill.py (main.py's GRPO job trains a teacher, a fresh
copy is distilled from it) and examples/sft_dpo.py, run in-process."""

from __future__ import annotations

import json
import math

from tests.support.examples_helpers import load_example


def test_distill_example_smoke(tmp_path):
    summary = load_example("distill").main(["--smoke", "--output-dir", str(tmp_path)])
    assert (tmp_path / "teacher" / "final" / "config.json").exists()  # main.py's run wrote the teacher
    rows = [json.loads(line) for line in (tmp_path / "distill.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(math.isfinite(r["reverse_kl"]) and math.isfinite(r["grad_norm"]) for r in rows[1:])
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows if "accuracy" in r) and "accuracy" in rows[-1]
    assert summary["student_start"] == rows[0]["accuracy"] and summary["student_final"] == rows[-1]["accuracy"]
    assert (tmp_path / "distill_curve.png").stat().st_size > 1000


def test_sft_dpo_example_smoke():
    out = load_example("sft_dpo").main(["--smoke"])
    before, after = out["sft"]
    assert after < before  # two SFT steps lower the held-out NLL of the demonstrated replies
    dpo_before, dpo_after = out["dpo"]
    assert dpo_before == 0.0  # a fresh adapter is its own reference: every margin is exactly 0
    assert 0.0 <= dpo_after <= 1.0
