"""The OpenAI-compatible vLLM server under load and faults, with trimpass (tiny random Gemma3 as its
own trimmed drafter, fp32, in check mode).

72 requests (64 good ones, each prompt from its own id range, plus 8 bad ones interleaved) at
concurrency 16 into a 12-block KV cache, so vLLM preempts and resumes requests; a third of the
streamed requests disconnect mid-stream. All-greedy traffic runs twice without speculation (vLLM's
own flip rate) and once trimmed; mixed greedy and sampled traffic runs trimmed and untrimmed (vLLM's
CPU build corrupts greedy requests beside sampled ones under speculation, untrimmed too: a strict
xfail). The workers' counters come from the files they write (``stats_dir``):
rows must drain to 0, no row may hold an id that is neither its request's own token nor the fixed
core (``foreign``), nor miss one of its own tokens (``missing``: a row not rebuilt on resume), and
the bytes held stay within their bounds. Bad settings stop the server before it serves, in one
line."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from trimpass.testing import serve_load as sl  # noqa: E402

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import vllm_run  # noqa: E402

KEEP = list(range(512))  # the fixed core, no learned core: a row is the core and its own tokens
MAX_LEN, CONC = 128, 16
ARGS = ["--served-model-name", "tiny", "--skip-tokenizer-init", "--dtype", "float32",
        "--max-model-len", str(MAX_LEN), "--enforce-eager", "--max-num-seqs", str(CONC),
        "--num-gpu-blocks-override", "12", "--block-size", "32", "--gpu-memory-utilization", "0.2"]


def _env(tmp):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                             "TRIMPASS_DISABLE", "TRIMPASS_VLLM")}
    env["TRIMPASS_CACHE"] = str(tmp / "cache")
    return env


def _serve(model, tmp, name, spec, reqs):
    from trimpass.serving import vllm as tv
    with sl.Server(model, ARGS + (tv.cli_args(spec) if spec else []),
                   str(tmp / f"{name}.log"), _env(tmp)) as s:
        results, wall = sl.drive(s.url, "tiny", reqs, CONC, 300)
        metrics = sl.server_metrics(s.url)
        stats = sl.worker_stats(str(tmp / name), until_rows_zero=20) if spec else []
    return {"results": results, "summary": sl.summary(results, wall), "metrics": metrics,
            "stats": stats}


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """All-greedy traffic without speculation (twice) and trimmed; mixed greedy and sampled
    traffic (the same prompts) trimmed and untrimmed."""
    tmp = tmp_path_factory.mktemp("serve")
    model = str(tmp / "gemma3")
    vllm_run.make_model(model)
    from trimpass.serving import vllm as tv

    def trimmed(name):
        return tv.engine_args(model, None, vllm_run.K, check=True, learn_core=0, keep=KEEP,
                              capacity=1024, stats_dir=str(tmp / name))
    plain = tv.engine_args(model, None, vllm_run.K, trim=False)
    greedy = sl.plan(64, vllm_run.V, MAX_LEN, seed=3, sampled=0.0)
    mixed = sl.plan(64, vllm_run.V, MAX_LEN, seed=3, sampled=0.25)
    runs = {name: _serve(model, tmp, name, spec, reqs) for name, spec, reqs in (
        ("none", None, greedy), ("none2", None, greedy), ("trim", trimmed("trim"), greedy),
        ("trim-mixed", trimmed("trim-mixed"), mixed), ("plain-mixed", plain, mixed))}
    return {"greedy": greedy, "mixed": mixed}, runs


def _reqs(plans, name):
    return plans["mixed" if name.endswith("mixed") else "greedy"]


def test_every_good_request_is_served_or_aborted_and_every_bad_one_rejected(load):
    plans, runs = load
    for name, run in runs.items():
        reqs = _reqs(plans, name)
        bad = [r.i for r in reqs if r.bad]
        assert len(reqs) - len(bad) == 64 and len(bad) == 8
        s, by_i = run["summary"], {r.req.i: r for r in run["results"]}
        assert all(400 <= by_i[i].status < 500 for i in bad), name
        good = [by_i[r.i] for r in reqs if not r.bad]
        assert all(r.status == 200 and r.error is None for r in good), \
            [(r.req.i, r.status, r.error) for r in good if r.status != 200 or r.error]
        assert all(len(r.tokens) == r.req.max_tokens for r in good if not r.aborted), name
        assert s["aborted"] >= 8 and s["served"] == 64 - s["aborted"] and s["failed"] == 0, s
        # the load preempts by its timing: required where trimpass runs (its rows must be
        # rebuilt on resume); vLLM's own runs preempted or not (twice none on a loaded 2-core VM)
        assert not run["stats"] or run["metrics"].get("vllm:num_preemptions", 0) >= 1, \
            (name, run["metrics"])


def test_greedy_outputs_under_preemption_and_aborts_are_no_worse_than_vllms_own(load):
    _, runs = load
    ref = sl.greedy_outputs(runs["none"]["results"])
    own, n_own = sl.flips(ref, sl.greedy_outputs(runs["none2"]["results"]))
    ours, n = sl.flips(ref, sl.greedy_outputs(runs["trim"]["results"]))
    assert n >= 40 and n_own >= 40
    assert ours / n <= own / n_own, (ours, n, own, n_own)
    assert runs["trim"]["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.xfail(strict=True, reason="vLLM 0.32's CPU build: with speculation, greedy requests "
                   "that share a batch with sampled ones diverge from their own greedy decoding, "
                   "untrimmed (measured: 41 of 44); trimpass's route inherits it")
def test_vllms_own_speculation_keeps_greedy_requests_beside_sampled_ones(load):
    _, runs = load
    ref = sl.greedy_outputs(runs["none"]["results"])
    got = sl.greedy_outputs(runs["plain-mixed"]["results"])
    assert sl.flips(ref, got)[0] == 0


@pytest.mark.parametrize("name", ["trim", "trim-mixed"])
def test_rows_drain_to_zero_and_never_hold_another_requests_ids(load, name):
    stats = load[1][name]["stats"]
    assert len(stats) == 1, stats
    s = stats[0]
    assert s["rows"] == 0 and s["peak_rows"] >= 4, s  # released as requests left, not later
    assert s["calls"] > 0 and s["fallbacks"] == 0 and s["violations"] == 0, s
    assert s["isolation_checked"] > 0 and s["foreign"] == 0 and s["missing"] == 0, s
    assert 0 < s["peak_state_bytes"] <= s["state_bound"], s
    assert 0 < s["peak_compact_bytes"] <= s["compact_bound"], s


@pytest.mark.parametrize("text, match", [
    ("{not json", "trimpass.json: not a JSON object of trimpass settings"),
    ('{"trim": true, "keeep": [1]}', "trimpass.json: keeep: not a trimpass setting"),
    ('{"vocab": [1, 2, 4096]}', "trimpass.json: vocab"),
])
def test_bad_settings_stop_the_server_before_it_serves_in_one_line(tmp_path, monkeypatch, text,
                                                                     match):
    """The command line's fallback: settings in trimpass.json beside a linked drafter copy."""
    model = str(tmp_path / "gemma3")
    vllm_run.make_model(model)
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path / "cache"))
    from trimpass.serving import vllm as tv
    spec = {"method": "draft_model", "model": tv.settings_dir(model, {}),
            "num_speculative_tokens": 3}
    with open(os.path.join(spec["model"], "trimpass.json"), "w") as f:
        f.write(text)
    p = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port",
                        str(sl.free_port()), "--host", "127.0.0.1", "--model", model, *ARGS,
                        "--speculative-config", json.dumps(spec)], capture_output=True,
                       text=True, env=_env(tmp_path), timeout=300)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and last.startswith("trimpass: ") and match in last, p.stderr[-3000:]
    assert "EngineCore" not in p.stderr  # stopped before any engine process started
