"""trimpass on vLLM's EAGLE routes (its CPU build): a tiny random Llama target with a one-layer
random EAGLE drafter (the target's head shared) and an EAGLE-3 drafter (its own 1,024-id head over
the target's 2,048 ids, a ``d2t`` map), both trimmed in the check mode (every call also computes
the plain head: a row's finite logits must be exactly its active ids inside the head's
vocabulary, equal there). Each engine runs in a fresh subprocess (``vllm_eagle_run.py``), its
engine core in that process (``test_vllm.py`` covers the engine's own processes). Skipped where
vLLM is not installed."""
import json

import pytest

pytest.importorskip("vllm")

KEEP = list(range(512))
SETTINGS = {"check": True, "learn_core": 0, "keep": KEEP, "capacity": 1024}
K = 3


def _run(root, mode):
    from tests.serving.vllm_run import run_script
    return run_script("vllm_eagle_run.py", str(root), mode, json.dumps(SETTINGS), in_process=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return {m: _run(root, m) for m in ("none", "eagle", "eagle3", "gemma-none", "gemma-eagle")}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_lossless_at_concurrency_1_and_6(runs, method):
    none, trim = runs["none"], runs[method]
    assert trim["solo"] == none["solo"] and trim["together"] == none["together"]
    assert len({tuple(o) for o in none["solo"]}) == len(none["solo"])  # outputs differ
    assert 0 < trim["accepted"] < trim["drafted"]  # drafts both accepted and rejected


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_trimmed_op_ran_on_every_draft_step_and_is_exact(runs, method):
    s = runs[method]["stats"]
    assert s["workers"] == 1 and s["steps"] > 0
    assert s["calls"] == K * s["steps"] and s["fallbacks"] == 0  # K draft calls a step
    assert s["checked"] == s["calls"] and s["violations"] == 0
    assert s["max_abs_err"] < 1e-3
    assert s["foreign"] == 0 and s["missing"] == 0 and s["isolation_checked"] > 0


def test_eagle3_ids_outside_the_draft_vocabulary_stay_minus_inf(runs):
    """Rows hold target ids the EAGLE-3 head cannot score (every other id of the rare prompts'
    ranges is outside its vocabulary): the check mode found each row finite exactly on its
    active ids inside the head's vocabulary, so those stayed -inf.
    """
    r, vocab = runs["eagle3"], set(runs["eagle3"]["draft_targets"])
    outside = {i for ids in r["stats"]["seen"].values() for i in ids} - vocab
    assert outside and r["stats"]["violations"] == 0
    assert r["stats"]["mean_union"] < r["stats"]["mean_active"]  # only ids inside are computed


def test_a_drafter_trimpass_trained_serves_beside_a_gemma_target(runs):
    """trimpass.train.eagle's checkpoint loads on vLLM's eagle route beside a Gemma3 target (which
    has no EAGLE-3 support in vLLM 0.32): lossless, trimmed on every draft step."""
    none, r = runs["gemma-none"], runs["gemma-eagle"]
    assert r["solo"] == none["solo"] and r["together"] == none["together"]
    s = r["stats"]
    assert s["workers"] == 1 and s["calls"] == K * s["steps"] > 0 and s["fallbacks"] == 0
    assert s["checked"] == s["calls"] and s["violations"] == 0


def test_rows_follow_requests_on_the_eagle_route(runs):
    """Each request's active ids are the fixed core plus its own prompt and output."""
    r = runs["eagle"]
    seen, prompts, outs = r["stats"]["seen"], r["prompts"], r["solo"] + r["together"]
    assert len(seen) == len(outs)
    for rid, ids in seen.items():
        i = int(rid.split("-")[0])
        own = set(KEEP) | set(prompts[i % len(prompts)]) | set(outs[i])
        assert set(ids) <= own and set(prompts[i % len(prompts)]) <= set(ids)
