"""trimpass in a real vLLM engine (its CPU build), tiny random Gemma3 as its own drafter.

Skipped where vLLM is not installed (the main venv); runs in the ``[vllm]`` venv. Each mode is one
engine in a fresh subprocess (``vllm_run.py``): no speculation, the untrimmed drafter and the
trimmed drafter in its ``check`` mode, where every trimmed call also computes the plain head and
counts rows whose finite logits are not exactly their active ids, or differ there.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

HERE = os.path.dirname(__file__)
KEEP = list(range(512))  # a fixed core, no learning: a row's ids are the core and its own tokens
SETTINGS = {"check": True, "learn_core": 0, "keep": KEEP, "capacity": 1024}


def _run(model_dir, mode):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.pop("TRIMPASS_DISABLE", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "vllm_run.py"), model_dir, mode,
                        json.dumps(SETTINGS)], capture_output=True, text=True, env=env,
                       timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny") / "gemma3")
    return {m: _run(d, m) for m in ("none", "plain", "trim")}


def test_lossless_at_concurrency_1_and_6(runs):
    none, plain, trim = runs["none"], runs["plain"], runs["trim"]
    assert trim["solo"] == none["solo"] == plain["solo"]
    assert trim["together"] == none["together"] == plain["together"]
    assert len({tuple(o) for o in none["solo"]}) == len(none["solo"])  # outputs differ
    # drafts were both accepted and rejected with trimming, so both paths of the check ran
    assert 0 < trim["accepted"] < trim["drafted"]
    assert plain["accepted"] > trim["accepted"]


def test_trimmed_op_ran_on_every_draft_step_and_is_exact(runs):
    s = runs["trim"]["stats"]
    assert s["workers"] == 1 and s["steps"] > 0
    assert s["calls"] == 3 * s["steps"] and s["fallbacks"] == 0  # K = 3 draft calls a step
    assert s["checked"] == s["calls"] and s["violations"] == 0  # -inf exactly off the active set
    assert s["max_abs_err"] < 1e-3
    assert len(KEEP) <= s["mean_active"] < 1024
    assert "stats" in runs["plain"] and runs["plain"]["stats"]["workers"] == 0


def test_rows_are_isolated_between_requests(runs):
    """Every request's active ids are the core plus its own prompt and output: two concurrent
    requests with disjoint rare ids (>= 1800) never see each other's."""
    r = runs["trim"]
    seen, prompts = r["stats"]["seen"], r["prompts"]
    outs = r["solo"] + r["together"]
    assert len(seen) == len(outs)
    for rid, ids in seen.items():
        i = int(rid.split("-")[0])  # vLLM numbers requests in the order they were added
        own = set(KEEP) | set(prompts[i % len(prompts)]) | set(outs[i])
        assert set(ids) <= own, f"request {rid} saw ids of another request"
        assert set(prompts[i % len(prompts)]) <= set(ids)  # its context is active
    for i in (0, 6):  # prompt 0 (ids 1800..) and prompt 1 (1900..), alone and concurrent
        a, b = seen[next(k for k in seen if k.startswith(f"{i}-"))], set(prompts[1])
        assert not (set(a) & b - set(outs[i]))
