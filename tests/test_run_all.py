"""A CPU smoke run of ``benchmarks/run_all.py``: two systems (stock and FreeToken q*) serve
the same scaled-down workload in turn; the combined report, roofline rows, serving plot,
routing trace and replay plot are all written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_run_all_cpu_smoke(tiny_checkpoint, tmp_path):
    from sglang_cpu import cpu_env

    path = tiny_checkpoint("qwen3_moe", num_layers=4, num_experts=16, top_k=4)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--model-path", path,
         "--cpu", "--systems", "stock-gpu,ft-qstar", "--workloads", "W1,W2", "--scale", "0.01",
         "--decode-cap", "3", "--bandwidth", "20,40", "--out-dir", str(out)],
        env=cpu_env(), capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["stock-gpu", "ft-qstar"]
    ft = runs[1]
    assert ft["freetoken"]["delta"]["total"]["reads"] > 0
    assert ft["freetoken"]["after"]["miss_policy"] == "qstar"
    for r in runs:
        assert r["summary"]["errors"] == 0
        assert r["summary"]["mean_decode_tok_s"] > 0
    roof = json.loads((out / "roofline.json").read_text())
    assert {row["workload"] for row in roof} == {"W1", "W2"}
    assert all(0 < row["achieved_over_bound"] for row in roof)
    assert (out / "serving.png").stat().st_size > 0
    assert (out / "traces" / "ft-qstar.npz").exists()
    assert any(f.endswith(".png") for f in os.listdir(out / "replay"))
    assert "Roofline" in (out / "report.md").read_text()
