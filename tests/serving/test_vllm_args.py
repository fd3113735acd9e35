"""trimpass.serving.vllm's checks before any engine starts (no vLLM needed)."""
import json
import os
import sys

import pytest

from trimpass.config import TrimpassError
from trimpass.serving import vllm as tv
from trimpass.serving import vllm_version as vv


def _ckpt(path, V, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": V, **cfg}))
    return str(path)


def _as(monkeypatch, version, mismatches=()):
    """This process's vLLM reads as ``version`` with ``mismatches`` (its verdict cached)."""
    monkeypatch.setattr(vv, "_verdicts", {version: vv.Verdict(version, list(mismatches))})
    monkeypatch.setattr(vv, "verdict", lambda v=None, read=None: vv._verdicts[v or version])


@pytest.fixture
def any_vllm(monkeypatch, tmp_path):
    _as(monkeypatch, tv.TESTED_VERSION)
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path / "cache"))


def test_without_vllm_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.raises(ImportError, match=r"trimpass\[vllm\]"):
        tv.engine_args(t, d)


MISMATCH = ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model: parameters "
            "['self', 'batch'], recorded ['self', 'scheduler_output']")


def test_a_vllm_whose_signatures_differ_is_refused_naming_the_symbol(monkeypatch):
    _as(monkeypatch, "0.31.1", [MISMATCH])
    with pytest.raises(TrimpassError, match=r"vllm 0\.31\.1 differs .*GPUModelRunner\.execute_model"
                                            r".*tested with vllm 0\.32\.0"):
        tv.check_version()


def test_an_untested_vllm_that_matches_is_accepted_with_one_warning_but_not_self_drafting(
        tmp_path, monkeypatch):
    _as(monkeypatch, "0.33.0")
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path / "cache"))
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.warns(UserWarning, match=r"vllm 0\.33\.0 is untested \(tested: 0\.32\.0\)"):
        tv.engine_args(t, d)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tv.engine_args(t, d)  # one warning, not one per call
    for drafter in (None, t, tv.settings_dir(t, {})):  # the target's own checkpoint, or a link
        with pytest.raises(TrimpassError, match="writes into the target's KV cache.*tested vLLM "
                                                r"versions only \(0\.32\.0\)"):
            tv.engine_args(t, drafter, budget="dcut")
    with pytest.raises(TrimpassError, match="target's KV cache"):
        tv.check_startup(_spec(t), target_dir=t, additional_config={"trimpass": {}})
    tv.check_startup(_spec(d), target_dir=t, additional_config={"trimpass": {}})


def test_vocab_mismatch_and_bad_ids_fail_before_serving(tmp_path, any_vllm):
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 120)
    with pytest.raises(ValueError, match="drafter .* has 120 ids but the target .* has 100"):
        tv.engine_args(t, d)
    d2 = _ckpt(tmp_path / "d2", 100)
    with pytest.raises(TrimpassError, match="100"):
        tv.engine_args(t, d2, vocab=[1, 5, 100])
    with pytest.raises(TrimpassError, match="refresh_every"):
        tv.engine_args(t, d2, refresh_every=4)


def _extra(args):
    return args.get("additional_config", {}).get("trimpass")


def test_settings_reach_workers_through_additional_config(tmp_path, any_vllm, monkeypatch):
    monkeypatch.delenv("TRIMPASS_DISABLE", raising=False)
    monkeypatch.delenv(tv.ENV, raising=False)
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    assert tv.resolve(d) is None  # nothing asked: the plugin does nothing
    args = tv.engine_args(t, d, 3, learn_core=8, keep=range(4))
    assert args["speculative_config"] == {"method": "draft_model", "model": d,
                                          "num_speculative_tokens": 3}
    assert _extra(args) == {"trim": True, "learn_core": 8, "keep": [0, 1, 2, 3]}
    assert tv.resolve(d, _extra(args)) == {"learn_core": 8, "keep": [0, 1, 2, 3]}
    assert os.listdir(d) == ["config.json"] and not (tmp_path / "cache").exists()  # nothing written
    assert "additional_config" not in tv.engine_args(t, d, trim=False)  # nothing asked
    assert tv.cli_args(args) == ["--speculative-config", json.dumps(args["speculative_config"]),
                                 "--additional-config", json.dumps(args["additional_config"])]
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    assert tv.resolve(d, _extra(args)) is None


def test_the_command_lines_fallbacks_are_the_environment_then_the_settings_file(
        tmp_path, any_vllm, monkeypatch):
    monkeypatch.delenv("TRIMPASS_DISABLE", raising=False)
    monkeypatch.delenv(tv.ENV, raising=False)
    t = _ckpt(tmp_path / "t", 100)
    (tmp_path / "t" / "model.safetensors").write_bytes(b"weights")
    drafter = tv.settings_dir(t, {"learn_core": 8})
    assert drafter.startswith(str(tmp_path / "cache"))
    assert sorted(os.listdir(drafter)) == ["config.json", "model.safetensors", tv.SETTINGS_FILE]
    with open(os.path.join(drafter, "model.safetensors"), "rb") as f:
        assert f.read() == b"weights"
    assert sorted(os.listdir(t)) == ["config.json", "model.safetensors"]  # only read
    assert tv.resolve(drafter) == {"learn_core": 8}
    monkeypatch.setenv(tv.ENV, '{"capacity": 512}')
    assert tv.resolve(drafter) == {"capacity": 512}
    assert tv.resolve(drafter, {"keep": [1]}) == {"keep": [1]}  # additional_config first


def test_a_setting_additional_config_cannot_carry_is_refused(tmp_path, any_vllm):
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.raises(TrimpassError, match=r"^keep: additional_config carries JSON values only"):
        tv.engine_args(t, d, keep=object())
    with pytest.raises(TrimpassError, match=r"additional_config\['trimpass'\]: not a JSON object"):
        tv.check_startup(_spec(d), additional_config={"trimpass": [1, 2]})
    with pytest.raises(TrimpassError, match=r"additional_config\['trimpass'\]: capacity"):
        tv.check_startup(_spec(d), additional_config={"trimpass": {"capacity": 0}})


def test_a_hybrid_attention_target_gets_one_kv_cache_group(tmp_path, any_vllm):
    d = _ckpt(tmp_path / "d", 100)
    plain = _ckpt(tmp_path / "t", 100, layer_types=["full_attention"] * 2)
    hybrid = _ckpt(tmp_path / "h", 100, layer_types=["sliding_attention", "full_attention"])
    assert "disable_hybrid_kv_cache_manager" not in tv.engine_args(plain, d)
    assert tv.engine_args(hybrid, d)["disable_hybrid_kv_cache_manager"] is True


def test_budget_settings_reach_workers_trimmed_or_not(tmp_path, any_vllm, monkeypatch):
    monkeypatch.delenv("TRIMPASS_DISABLE", raising=False)
    monkeypatch.delenv(tv.ENV, raising=False)
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    e1 = _extra(tv.engine_args(t, d, 8, budget="dcut", learn_core=8))
    from dataclasses import asdict

    from trimpass.spec.config import SuffixConfig
    assert tv.resolve_budget(d, e1) == {"policy": "dcut", "measure_s": 10.0, "probe": 1 / 16,
                                        "lookup": {"ngram": 4, "tokens": 8},  # lookup: on
                                        "suffix": asdict(SuffixConfig()), "tenant": None}
    assert tv.resolve(d, e1) == {"learn_core": 8}  # the budget is not a trim setting
    e2 = _extra(tv.engine_args(t, d, 8, trim=False, budget={"policy": "fixed", "gamma": 3}))
    assert tv.resolve(d, e2) is None
    assert tv.resolve_budget(d, e2) == {"policy": "fixed", "gamma": 3, "measure_s": 10.0,
                                        "probe": 1 / 16, "lookup": None, "suffix": None,
                                        "tenant": None}
    assert tv.resolve_budget(d, _extra(tv.engine_args(t, d, 8))) is None
    e4 = _extra(tv.engine_args(t, d, 8, budget="dcut"))
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    assert tv.resolve_budget(d, e4) is None


@pytest.mark.parametrize("gamma,budget,match", [
    (0, "dcut", r"num_speculative_tokens: D-Cut needs a draft length >= 1"),
    (4, "greedy", r"budget policy: 'greedy' is not one of dcut, all-or-nothing, fixed, none, off"),
    (4, {"policy": "fixed"}, r"budget gamma: the fixed policy needs an integer 1..4"),
    (4, {"policy": "fixed", "gamma": 5}, r"budget gamma: .*1..4.*got 5"),
    (4, {"policy": "dcut", "gamma": 2}, r"budget gamma: only the fixed policy"),
    (4, {"policy": "dcut", "buckets": [8, 4]}, r"buckets: must be sorted strictly increasing"),
    (4, {"policy": "all-or-nothing", "buckets": [4]}, r"only the dcut policy takes buckets"),
    (4, {"policy": "dcut", "measure_s": 60}, r"budget measure_s: .* in \(0, 30\], got 60"),
    (4, {"policy": "dcut", "table": {"batches": [1], "drafts": [0, 4],
                                     "seconds": [[0.01, -1.0]]}},
     r"budget table: .*drafts=4 is missing or not positive"),
    (4, {"policy": "dcut", "table": {"batches": [1], "drafts": [0, 4], "seconds": [[0.01]]}},
     r"budget table: .*expected 1 rows of 2 entries"),
    (4, {"policy": "dcut", "speed": 1}, r"budget: unknown setting 'speed'"),
    (4, {"policy": "dcut", "lookup": {"ngram": 0}}, r"budget lookup ngram: .*positive integer"),
    (4, {"policy": "dcut", "lookup": {"tokens": 5}}, r"budget lookup tokens: .*1..4 "
                                                     r"\(num_speculative_tokens\), got 5"),
    (4, 3, r"budget: expected a policy name"),
])
def test_bad_budget_settings_fail_before_serving(tmp_path, any_vllm, gamma, budget, match):
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.raises(ValueError, match=match):
        tv.engine_args(t, d, gamma, budget=budget)
    assert not (tmp_path / "cache").exists()  # nothing written for the workers


@pytest.mark.parametrize("key", ["escape", "escape_rank", "refresh_every"])
def test_a_setting_the_route_cannot_run_is_refused_by_name(tmp_path, any_vllm, key):
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.raises(TrimpassError, match=rf"^{key}: vLLM's route"):
        tv.engine_args(t, d, **{key: 4})
    assert not (tmp_path / "cache").exists()


def test_the_engine_runs_without_the_escape_path():
    assert tv.checked_config({}, 100).settings.escape is None


def _spec(d):
    return {"method": "draft_model", "model": d, "num_speculative_tokens": 3}


@pytest.mark.parametrize("text, match", [
    ("{not json", r"trimpass\.json: not a JSON object of trimpass settings"),
    ('["keep"]', r"trimpass\.json: not a JSON object"),
    ('{"trim": true, "keeep": [1]}', r"trimpass\.json: keeep: not a trimpass setting"),
    ('{"vocab": [1, 2, 100]}', r"trimpass\.json: .*vocab"),
    ('{"budget": {"policy": "fixed", "gamma": 9}}', r"trimpass\.json: budget gamma"),
])
def test_a_bad_settings_file_stops_the_engine_before_it_starts(tmp_path, monkeypatch, any_vllm,
                                                               text, match):
    monkeypatch.delenv("TRIMPASS_VLLM", raising=False)
    d = _ckpt(tmp_path / "d", 100)
    (tmp_path / "d" / "trimpass.json").write_text(text)
    with pytest.raises(TrimpassError, match=match) as e:
        tv.check_startup(_spec(d))
    assert d in str(e.value)


def test_start_up_checks_pass_good_settings_and_other_routes(tmp_path, monkeypatch, any_vllm):
    monkeypatch.delenv("TRIMPASS_VLLM", raising=False)
    d = _ckpt(tmp_path / "d", 100)
    tv.check_startup(_spec(d))  # no trimpass.json: nothing asked, nothing checked
    (tmp_path / "d" / "trimpass.json").write_text('{"trim": true, "vocab": [1, 2, 99]}')
    tv.check_startup(_spec(d))
    tv.check_startup(json.dumps(_spec(d)))  # the command line's string form
    tv.check_startup({"method": "ngram", "num_speculative_tokens": 3})
    tv.check_startup(None)


def test_a_vllm_that_differs_stops_the_engine_where_trimming_is_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("TRIMPASS_VLLM", raising=False)
    _as(monkeypatch, "0.31.1", [MISMATCH])
    d = _ckpt(tmp_path / "d", 100)
    tv.check_startup(_spec(d), version="0.31.1")  # nothing asked: it serves untrimmed
    (tmp_path / "d" / "trimpass.json").write_text('{"trim": true}')
    with pytest.raises(TrimpassError, match=r"trimpass\.json asks for trimming: vllm 0\.31\.1 "
                                            r"differs .*execute_model"):
        tv.check_startup(_spec(d), version="0.31.1")
    _as(monkeypatch, tv.TESTED_VERSION)
    monkeypatch.setenv("TRIMPASS_VLLM", '{"capacity": 0}')
    with pytest.raises(TrimpassError, match="the TRIMPASS_VLLM environment variable: capacity"):
        tv.check_startup(_spec(d))


def _eagle(path, V=100, hidden=16, d2t=None, **cfg):
    d = _ckpt(path, V, hidden_size=hidden, architectures=["LlamaForCausalLM"], **cfg)
    if d2t is not None:
        import torch
        from safetensors.torch import save_file
        save_file({"d2t": torch.tensor(d2t)}, os.path.join(d, "model.safetensors"))
    return d


@pytest.mark.parametrize("method, cfg, d2t, match", [
    ("eagle", {"hidden": 32}, None, r"hidden states of size 32, but the target .* hidden_size 16"),
    ("eagle3", {"V": 120}, None, r"vocab_size 120, but the target .* has 100"),
    ("eagle", {"draft_vocab_size": 4}, [0, 1, 2, 3], r"an EAGLE-3 head's own vocabulary; .*eagle3"),
    ("eagle3", {"draft_vocab_size": 140}, None, r"draft_vocab_size 140 exceeds the target's 100"),
    ("eagle3", {"draft_vocab_size": 4}, None, r"no d2t tensor"),
    ("eagle3", {"draft_vocab_size": 4}, [0, 1, 2], r"d2t has 3 entries for draft_vocab_size 4"),
    ("eagle3", {"draft_vocab_size": 4}, [0, 1, 2, 97], r"d2t: draft id 3 maps to target id 100"),
    ("eagle3", {"draft_vocab_size": 4}, [0, 1, 1, 0], r"d2t: two draft ids map to the same"),
])
def test_an_eagle_checkpoint_that_disagrees_with_its_target_fails_before_serving(
        tmp_path, any_vllm, method, cfg, d2t, match):
    t = _ckpt(tmp_path / "t", 100, hidden_size=16, architectures=["LlamaForCausalLM"])
    d = _eagle(tmp_path / "d", cfg.pop("V", 100), cfg.pop("hidden", 16), d2t, **cfg)
    with pytest.raises(ValueError, match=match):
        tv.engine_args(t, d, 3, method=method)
    if method == "eagle3" and d2t is not None:  # the API server's start-up check says it too
        (tmp_path / "d" / "trimpass.json").write_text("{}")
        with pytest.raises(TrimpassError, match=match):
            tv.check_startup({"method": method, "model": d}, target_dir=t)


def test_a_route_trimpass_does_not_trim_and_an_eagle_route_without_a_drafter_are_refused(
        tmp_path, any_vllm):
    t = _ckpt(tmp_path / "t", 100, hidden_size=16)
    with pytest.raises(ValueError, match="method: 'medusa' is not a vLLM route trimpass trims"):
        tv.engine_args(t, None, 3, method="medusa")
    with pytest.raises(ValueError, match="drafter_dir: method='eagle' needs an EAGLE drafter"):
        tv.engine_args(t, None, 3, method="eagle")


def test_local_argmax_reduction_is_refused_where_trimming_is_asked(tmp_path, monkeypatch,
                                                                   any_vllm):
    monkeypatch.delenv("TRIMPASS_VLLM", raising=False)
    d = _ckpt(tmp_path / "d", 100)
    spec = {**_spec(d), "use_local_argmax_reduction": True}
    tv.check_startup(spec)  # nothing asked
    (tmp_path / "d" / "trimpass.json").write_text("{}")
    with pytest.raises(TrimpassError, match="use_local_argmax_reduction .* without its "
                                            "compute_logits"):
        tv.check_startup(spec)


def test_eagle_routes_need_vllms_classes_for_the_drafter_and_the_target(tmp_path, any_vllm):
    pytest.importorskip("vllm")
    llama = _ckpt(tmp_path / "llama", 100, hidden_size=16, architectures=["LlamaForCausalLM"])
    gemma = _ckpt(tmp_path / "gemma", 100, hidden_size=16, architectures=["Gemma3ForCausalLM"])
    ok = _eagle(tmp_path / "ok", draft_vocab_size=4, d2t=[0, 1, 2, 3])
    args = tv.engine_args(llama, ok, 3, method="eagle3")
    assert args["speculative_config"]["method"] == "eagle3"
    with pytest.raises(ValueError, match=r"target .*Gemma3ForCausalLM.* does not give vLLM's "
                                         r"EAGLE-3 drafters"):
        tv.engine_args(gemma, ok, 3, method="eagle3")
    odd = _ckpt(tmp_path / "odd", 100, hidden_size=16, architectures=["OddForCausalLM"])
    with pytest.raises(ValueError, match="vLLM has no eagle drafter class EagleOddForCausalLM"):
        tv.engine_args(llama, odd, 3, method="eagle")
    assert tv.engine_args(gemma, _eagle(tmp_path / "e1"), 3, method="eagle")


@pytest.mark.parametrize("version, mismatches, places, self_drafting", [
    (tv.TESTED_VERSION, [], None, True),
    ("0.33.0", [], None, False),  # accepted: every wrapper, but not the target's own KV cache
    ("0.31.1", [MISMATCH], ("vllm.engine.arg_utils:EngineArgs.create_engine_config",), None),
])
def test_the_plugin_installs_what_the_version_allows(monkeypatch, version, mismatches, places,
                                                     self_drafting):
    from trimpass.serving import vllm_compat
    monkeypatch.delenv("TRIMPASS_DISABLE", raising=False)
    monkeypatch.delenv(tv.ENV, raising=False)
    _as(monkeypatch, version, mismatches)
    got = []
    monkeypatch.setattr(vllm_compat, "install", lambda hooks, places=None: got.append(
        (hooks, places)))
    tv.register()
    assert len(got) == 1 and got[0][1] == places
    if self_drafting is not None:
        assert got[0][0].self_drafting_ok is self_drafting
    monkeypatch.setenv(tv.ENV, "1")  # trimming asked through the environment: refused now
    if mismatches:
        with pytest.raises(TrimpassError, match="execute_model"):
            tv.register()
