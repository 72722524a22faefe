"""benchmarks/anchor_bench.py's accounting: the true new suffix, edited turns, the re-prefill
ratio and the anchor cuts it reports (no server)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import anchor_bench as ab  # noqa: E402


def test_suffix_edited_turns_and_ratios(tiny_checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3_5_moe"))
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    p0 = [im_start, 10, 11, 12, im_end]
    p1 = p0 + [20, 21, 22]  # extends p0: suffix 3
    p2 = [im_start, 10, 11, 99, im_end, 20, 21, 22, 30]  # edited at 3: suffix 6
    p3 = p2 + [40]  # suffix 1
    prompts = [p0, p1, p2, p3]
    monkeypatch.setattr(ab.wl, "render_ids", lambda tokenizer, request: request)
    reprefill = [5, 3, 9, 1]  # p2 re-prefilled from scratch
    recs = [{"prompt_tokens": len(p), "cached_tokens": len(p) - n, "prefill_tokens": n,
             "ttft_s": t} for p, n, t in zip(prompts, reprefill, (0.9, 0.2, 0.5, 0.3))]
    ab.annotate(recs, prompts, tok, min_distance=1, cuts_on=True)
    assert [r["suffix"] for r in recs] == [5, 3, 6, 1]
    assert [r["edited"] for r in recs] == [False, False, True, False]
    assert [r["cuts"] for r in recs] == [1, 0, 1, 0]  # at the im_end 4 tokens in
    m = ab.summarize_session(recs)
    assert (m["edited"], m["edited_reprefill"], m["edited_suffix"]) == (1, 9, 6)
    assert m["edited_ratio"] == 1.5 and m["all_ratio"] == 18 / 15
    assert m["worst_turn_ratio"] == 1.5 and m["cuts"] == 2 and m["mismatched"] == 0
    assert m["worst_ttft_s"] == 0.9 and m["steady_worst_ttft_s"] == 0.5
    assert m["steady_median_ttft_s"] == 0.4
    # without cuts no chunk ends; a prompt the server counted differently is flagged
    recs[3]["prompt_tokens"] += 1
    ab.annotate(recs, prompts, tok, min_distance=1, cuts_on=False)
    assert [r["cuts"] for r in recs] == [0, 0, 0, 0]
    assert ab.summarize_session(recs)["mismatched"] == 1


def test_system_flags():
    import pytest

    assert ab.system_flags("stock", 0.25) == []
    assert ab.system_flags("ft-anchors", 0.25) == ["--enable-freetoken",
                                                   "--freetoken-cache-ratio", "0.25"]
    assert "off" in ab.system_flags("ft-anchors-off", 0.25)
    with pytest.raises(SystemExit, match="unknown system 'ft-x'"):
        ab.system_flags("ft-x", 0.25)
    assert "no_buffer" in ab.system_flags("stock-no-buffer", 0.25)
    assert ab.system_flags("ft-anchors-cuts", 0.25)[-2:] == ["--freetoken-anchor-cuts", "on"]
    assert ab.system_flags("ft-anchors-d64", 0.25)[-1] == "64"
    assert ab.anchor_distance("ft-anchors-d64") == 64 and ab.anchor_distance("stock") is None


def test_report_compares_the_session_worst_with_stock():
    """The TTFT columns: steady median, steady worst and the whole session's worst (first turns
    included) over stock's on the same session."""

    def recs(ttfts):
        return [{"prompt_tokens": 4, "cached_tokens": 0, "prefill_tokens": 4, "suffix": 4,
                 "reprefill": 4, "edited": False, "cuts": 0, "ttft_s": t} for t in ttfts]

    runs = [{"label": "stock", "sessions": {"W2:last_n": {"requests": recs([2.0, 0.1, 0.2, 0.4])}}},
            {"label": "ft-anchors",
             "sessions": {"W2:last_n": {"requests": recs([1.5, 0.5, 0.6, 1.2])}}}]
    rows = ab.report(runs).splitlines()
    assert "session worst / stock's" in rows[0]
    ft = rows[-1].split(" | ")
    assert ft[0] == "| ft-anchors" and ft[6] == "1.50 / 0.90 / 1.20"
    # steady median 0.9 / 0.3, steady worst 1.2 / 0.4, session worst (first turns) 1.5 / 2.0
    assert ft[7] == "3.00, 3.00, 0.75 |"


def test_ttft_bound_splits_the_non_resident_experts_between_pcie_and_the_cpu():
    from benchmarks import ttft_bound as tb

    shape = tb.Shape(layers=2, experts=4, top_k=2, hidden=8, inter=4)  # S = 192 bytes
    # PCIe 192 B in 1 us; the CPU reads in 0.5 us, computes in 3 us (flat, then x tokens)
    m = tb.Machine(b_p=192e-3, b_h=384e-3, cpu_us=((1, 3.0), (4, 3.0)), hidden=8, inter=4)
    assert tb.cpu_time_us(m, shape, 8) == 6.0  # proportional beyond the last count
    # cache 0.5: 2 of 4 experts missing per layer; 100 tokens hit every one (1 - 0.5^100);
    # t = 50 tokens per expert: h = 3 x 50 / 4 = 37.5 us, p = 1 us
    assert abs(tb.turn_bound_s(m, shape, 0.5, 100) - 4 / (1 + 1 / 37.5) * 1e-6) < 1e-12
    # h = 3 us: 2 layers x 2 experts / (1/1 + 1/3) = 3 us
    big = tb.Machine(b_p=192e-3, b_h=384e-3, cpu_us=((1, 3.0), (1000, 3.0)), hidden=8,
                     inter=4)
    assert abs(tb.turn_bound_s(big, shape, 0.5, 100) - 3.0e-6) < 1e-12
    # one token: each missing expert is hit with probability 1/2
    assert abs(tb.turn_bound_s(big, shape, 0.5, 1) - 1.5e-6) < 1e-12
    assert tb.turn_bound_s(big, shape, 1.0, 100) == 0.0
    # a CPU at a given rate: 6 x 8 x 4 x 50 flops = 9600 flops at 1e-3 TFLOPS: 9.6 us
    fast = tb.Machine(b_p=192e-3, b_h=384e-3, cpu_us=(), hidden=8, inter=4, tflops=1e-3)
    assert abs(tb.cpu_time_us(fast, shape, 50) - 9.6) < 1e-9
    assert abs(tb.turn_bound_s(fast, shape, 0.5, 100) - 4 / (1 + 1 / 9.6) * 1e-6) < 1e-12
    # the bound falls with the missing experts: 1.5 us needs 1 missing: ratio 0.75
    assert abs(tb.ratio_for(big, shape, 0.5, 100, 1.5e-6) - 0.75) < 1e-6
