"""trimpass in a real vLLM engine (its CPU build), tiny random Gemma3 as its own drafter.

Skipped where vLLM is not installed (the main venv); runs in the ``[vllm]`` venv. Each mode is one
engine in a fresh subprocess (``vllm_run.py``): no speculation, the untrimmed drafter and the
trimmed drafter in its ``check`` mode, where every trimmed call also computes the plain head and
counts rows whose finite logits are not exactly their active ids, or differ there; and D-Cut
(the trimmed drafter with a verification budget), then a fixed draft length switched on live.
"""
import json

import pytest

pytest.importorskip("vllm")

KEEP = list(range(512))  # a fixed core, no learning: a row's ids are the core and its own tokens
SETTINGS = {"check": True, "learn_core": 0, "keep": KEEP, "capacity": 1024}


def _run(model_dir, mode, **extra_env):
    from tests.serving.vllm_run import run_script
    return run_script("vllm_run.py", model_dir, mode, json.dumps(SETTINGS), **extra_env)


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
    # the target drafting for itself on its own cache: every drafting step's first forward ran
    # over each request's next token alone (6 prompts solo, then together)
    assert s["shared_cache"]["first_pass_rows"] >= s["steps"]
    assert "shared_cache" not in runs["plain"]["stats"]


def test_tensor_parallel_2_is_lossless_and_each_shard_trims_its_own_ids(runs, tmp_path):
    """vLLM shards the drafter's head by vocabulary over 2 CPU workers (threads bound by hand:
    one NUMA node here); each shard's trimmed op computes only the active ids in its slice."""
    tp = _run(str(tmp_path / "gemma3"), "trim-tp2", VLLM_CPU_OMP_THREADS_BIND="0|1")
    assert tp["solo"] == runs["none"]["solo"] and tp["together"] == runs["none"]["together"]
    s, one = tp["stats"], runs["trim"]["stats"]
    assert s["workers"] == 2 and s["steps"] > 0
    assert s["calls"] == 3 * s["steps"] and s["fallbacks"] == 0
    assert s["checked"] == s["calls"] and s["violations"] == 0 and s["max_abs_err"] < 1e-3
    assert s["mean_union"] < 0.75 * one["mean_union"]  # a shard holds about half the ids
    assert s["shared_cache"]["first_pass_rows"] >= s["steps"]  # steps and rows: both workers


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


def _chi2_p(counts, probs):
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (bins expected < 5 merged)."""
    import torch
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


@pytest.mark.xfail(strict=True, reason=(
    "vLLM 0.32's CPU build: speculative decoding with temperature does not keep the target's "
    "distribution even untrimmed (a draft_model drafter, greedy or probabilistic drafts, trimpass "
    "disabled: the second token is 0 in 1,066 of 3,000 samples, 158 without speculation); strict, "
    "so a vLLM that fixes it makes this test fail until the mark is removed"))
def test_with_temperature_the_emitted_distribution_is_the_targets(tmp_path):
    """Temperature 1 with probabilistic drafts from the trimmed head (zero probability off a
    row's active ids): the second token (the first one verified against drafts) follows the
    target's distribution; the same samples tested against the trimmed drafter's own
    distribution (what emitting drafts unverified would give) are rejected: the negative
    control shows the test can tell."""
    import torch
    from transformers import Gemma3ForCausalLM

    from tests.serving import vllm_run as vr
    d = str(tmp_path / "v64")
    keep = list(range(16))
    r = vr.run_script("vllm_run.py", d, "sample",
                      json.dumps({"learn_core": 0, "keep": keep, "capacity": 32}), in_process=True)
    assert r["stats"]["calls"] > 0 and r["stats"]["fallbacks"] == 0
    V, prompt = vr.SAMPLE_V, vr.SAMPLE_PROMPT
    m = Gemma3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = m(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = m(torch.tensor([prompt + [x] for x in range(V)])).logits[:, -1].softmax(-1)
    active = torch.zeros(V, V, dtype=torch.bool)  # row x1: keep + prompt + x1
    active[:, keep + prompt] = True
    active[torch.arange(V), torch.arange(V)] = True
    q2 = torch.where(active, p2, 0.0)
    q2 = q2 / q2.sum(1, keepdim=True)
    counts = torch.bincount(torch.tensor([pair[1] for pair in r["pairs"]]), minlength=V).double()
    assert _chi2_p(counts, (p1 @ q2).double()) < 1e-6  # the negative control rejects
    assert _chi2_p(counts, (p1 @ p2).double()) > 1e-3


# a drafted token costs 0.02 s on top of 11-18 s: some drafted tokens pay, others not. Seconds so
# long that the drafting time the engine measures (ms) cannot sway the cut: the test's decisions
# depend on the drafts alone, not on this machine's load
DCUT_TABLE = {"batches": [1, 8], "drafts": [0, 32],
              "seconds": [[11.0, 11.0 + 0.02 * 32], [17.6, 17.6 + 0.02 * 32]]}


@pytest.fixture(scope="module")
def dcut_run(runs, tmp_path_factory):
    from tests.serving.vllm_run import run_script
    d = str(tmp_path_factory.mktemp("tiny_dcut") / "gemma3")
    return run_script("vllm_run.py", d, "dcut", json.dumps({"policy": "dcut", "table": DCUT_TABLE}),
                      in_process=True)


def test_dcut_in_vllm_is_lossless_and_verifies_per_request_prefixes(runs, dcut_run):
    for name in ("dcut", "fixed"):
        r = dcut_run[name]
        assert r["together"] == runs["none"]["together"], name
        assert r["fallbacks"] == 0 and r["calls"] > 0
        b = r["budget"]
        # what the runner was asked to verify is what vLLM counted as verified drafts
        assert b["verified"] == r["verified_drafts"] > 0, name
    dc = dcut_run["dcut"]["budget"]
    assert dc["policy"] == "dcut"
    # the requests' own text drafted too (lookup, the suffix index), priced by what the target
    # accepted of it
    free = {k: dc.get(f"lookup_{k}", 0) + dc.get(f"suffix_{k}", 0) for k in ("accepted", "sent")}
    assert dc["lookup_rows"] > 0 and 0 < free["accepted"] <= free["sent"]
    assert sum(dc["lookup_price"]["reached"]) + sum(dc["suffix_price"]["reached"]) > 0
    assert sum(dc["self_price"]["reached"]) > 0
    assert dc["verified_mixed"] > 0  # one step verified drafts of different lengths
    assert int(min(dc["kept"], key=int)) < int(max(dc["kept"], key=int))  # K varies by step
    fx = dcut_run["fixed"]["budget"]
    assert fx["policy"] == "fixed" and fx["gamma"] == 1
    assert fx["verified_max"] == 1 and set(fx["depth"]) == {"1"}  # switched live: 1 token drafted
