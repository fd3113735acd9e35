"""trimpass.serving.vllm's checks before any engine starts (no vLLM needed)."""
import json
import sys

import pytest

from trimpass.config import TrimpassError
from trimpass.serving import vllm as tv


def _ckpt(path, V, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": V, **cfg}))
    return str(path)


@pytest.fixture
def any_vllm(monkeypatch):
    monkeypatch.setattr(tv, "_vllm_version", lambda: tv.TESTED_VERSION)


def test_without_vllm_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    with pytest.raises(ImportError, match=r"trimpass\[vllm\]"):
        tv.engine_args(t, d)


def test_another_vllm_version_is_refused():
    with pytest.raises(RuntimeError, match="tested with vllm 0.32.0 only, this is vllm 0.31.1"):
        tv.check_version("0.31.1")


def test_vocab_mismatch_and_bad_ids_fail_before_serving(tmp_path, any_vllm):
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 120)
    with pytest.raises(ValueError, match="drafter .* has 120 ids but the target .* has 100"):
        tv.engine_args(t, d)
    d2 = _ckpt(tmp_path / "d2", 100)
    with pytest.raises(TrimpassError, match="100"):
        tv.engine_args(t, d2, vocab=[1, 5, 100])
    with pytest.raises(TrimpassError, match="refresh_every"):
        tv.engine_args(t, d2, refresh_every=4)


def test_settings_reach_workers_through_the_file_and_env(tmp_path, any_vllm, monkeypatch):
    monkeypatch.delenv("TRIMPASS_DISABLE", raising=False)
    monkeypatch.delenv(tv.ENV, raising=False)
    t, d = _ckpt(tmp_path / "t", 100), _ckpt(tmp_path / "d", 100)
    assert tv.resolve(d) is None  # nothing asked: the plugin does nothing
    args = tv.engine_args(t, d, 3, learn_core=8, keep=range(4))
    assert args["speculative_config"] == {"method": "draft_model", "model": d,
                                          "num_speculative_tokens": 3}
    assert tv.resolve(d) == {"learn_core": 8, "keep": [0, 1, 2, 3]}
    tv.engine_args(t, d, trim=False)
    assert tv.resolve(d) is None
    monkeypatch.setenv(tv.ENV, '{"capacity": 512}')
    assert tv.resolve(d) == {"capacity": 512}
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    assert tv.resolve(d) is None


def test_a_hybrid_attention_target_gets_one_kv_cache_group(tmp_path, any_vllm):
    d = _ckpt(tmp_path / "d", 100)
    plain = _ckpt(tmp_path / "t", 100, layer_types=["full_attention"] * 2)
    hybrid = _ckpt(tmp_path / "h", 100, layer_types=["sliding_attention", "full_attention"])
    assert "disable_hybrid_kv_cache_manager" not in tv.engine_args(plain, d)
    assert tv.engine_args(hybrid, d)["disable_hybrid_kv_cache_manager"] is True
