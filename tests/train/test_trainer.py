"""trimpass.train.trainer (+ cache, data) on a tiny random Gemma-3 (V=300, d=32): each loss and the
GRPO stage lower the loss, resume is bit-for-bit by step, only the trained parameters move, and bad
input fails with a clear error before any compute, writing nothing."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from tests.train.conftest import KW, S, V, fresh, tiny  # noqa: E402
from trimpass.models import drafter_from  # noqa: E402
from trimpass.select.corpora import Doc, held_out  # noqa: E402
from trimpass.train.cache import build_cache, load_cache  # noqa: E402
from trimpass.train.data import pack, train_docs  # noqa: E402
from trimpass.train.trainer import evaluate, train  # noqa: E402


@pytest.mark.parametrize("loss,grpo,active", [("kl", False, None), ("eal", False, None),
                                              ("wtv", False, None), ("wtv", False, "act"),
                                              ("eal", True, None)])
def test_training_lowers_the_loss(target, cache, tmp_path, loss, grpo, active):
    d = fresh(target)
    act = torch.arange(0, V, 3) if active else None
    frozen = {n: p.clone() for n, p in d.named_parameters()
              if not n.startswith(("model.layers.1.", "model.norm"))}
    ev = dict(loss="eal" if grpo else loss, gamma=3, active=act)
    before = evaluate(d, cache, **ev)
    kw = dict(KW, tokens=1, grpo_tokens=20 * 2 * S) if grpo else KW  # GRPO does the work
    r = train(d, cache, loss=loss, grpo=grpo, active=act, out_dir=str(tmp_path), **kw)
    after = evaluate(d, cache, **ev)
    assert after < before, (loss, before, after)
    assert r.steps == (21 if grpo else 20) and r.tokens_per_s > 0 and r.wall_s > 0
    assert len(r.rewards) == (20 if grpo else 0)
    for n, p in d.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert not any(p.requires_grad for p in d.parameters())
    assert (tmp_path / "drafter.safetensors").exists()


def test_resume_is_bit_for_bit(target, cache, tmp_path):
    a, b = fresh(target), fresh(target)
    kw = dict(KW, loss="wtv", active=torch.arange(0, V, 2))
    train(a, cache, out_dir=str(tmp_path / "a"), **dict(kw, tokens=10 * 2 * S))
    train(b, cache, out_dir=str(tmp_path / "b"), **dict(kw, tokens=5 * 2 * S))
    c = fresh(target)  # a new process: the drafter is rebuilt, the checkpoint brings it back
    r = train(c, cache, out_dir=str(tmp_path / "b"), **dict(kw, tokens=10 * 2 * S))
    assert r.steps == 10 and len(r.losses) == 5
    for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_resume_grpo_is_bit_for_bit(target, cache, tmp_path):
    a, c = fresh(target), fresh(target)
    kw = dict(KW, loss="eal", grpo=True, tokens=2 * 2 * S, grpo_tokens=4 * 2 * S, ckpt_every=4)
    train(a, cache, out_dir=str(tmp_path / "a"), **kw)
    train(fresh(target), cache, out_dir=str(tmp_path / "b"), **dict(kw, grpo_tokens=2 * 2 * S))
    # the first run stopped at step 4 (2 base + 2 GRPO); a longer GRPO budget changes no setting
    r = train(c, cache, out_dir=str(tmp_path / "b"), **kw)
    assert r.steps == 6
    for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("kw,match", [
    (dict(gamma=0), "gamma"), (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"), (dict(active=torch.tensor([], dtype=torch.long)),
                                              "empty"),
    (dict(active=torch.tensor([0, V])), r"\[0, V=300\)"), (dict(loss="ce"), "loss"),
    (dict(gamma=S + 1), "gamma"), (dict(tokens=0), "tokens")])
def test_bad_input_fails_before_compute(target, cache, tmp_path, kw, match):
    d = fresh(target)
    with pytest.raises(ValueError, match=match):
        train(d, cache, out_dir=str(tmp_path / "out"), **{**KW, **kw})
    assert not (tmp_path / "out").exists()


def test_vocabularies_differ(cache, tmp_path):
    d = drafter_from(tiny(2, vocab=V + 2), 2)
    with pytest.raises(ValueError, match="vocabularies differ"):
        train(d, cache, out_dir=str(tmp_path / "out"), **KW)
    assert not (tmp_path / "out").exists()


def test_corrupt_cache_and_checkpoint(target, cache, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{junk...")
    with pytest.raises(ValueError, match="bad.safetensors is corrupt.*delete it"):
        train(fresh(target), str(bad), out_dir=str(tmp_path / "out"), **KW)
    with pytest.raises(ValueError, match="corrupt.*delete it"):  # before running the target
        build_cache(None, cache.ids, model_key="tiny", k=8, path=str(bad))
    assert not (tmp_path / "out").exists()
    out = tmp_path / "ck"
    train(fresh(target), cache, out_dir=str(out), **dict(KW, tokens=2 * 2 * S))
    (out / "checkpoint.safetensors").write_bytes(b"nonsense")
    listing = sorted(p.name for p in out.iterdir())
    d = fresh(target)
    before = {n: p.clone() for n, p in d.named_parameters()}
    with pytest.raises(ValueError, match="checkpoint.safetensors is corrupt.*delete it"):
        train(d, cache, out_dir=str(out), **dict(KW, tokens=4 * 2 * S))
    assert sorted(p.name for p in out.iterdir()) == listing
    assert all(torch.equal(p, before[n]) for n, p in d.named_parameters())
    assert not any(p.requires_grad for p in d.parameters())
    (out / "checkpoint.json").write_text("{")
    with pytest.raises(ValueError, match="checkpoint.json is corrupt"):
        train(d, cache, out_dir=str(out), **dict(KW, tokens=4 * 2 * S))
    with pytest.raises(ValueError, match="other settings"):
        train(fresh(target), cache, out_dir=str(tmp_path / "ck2"), **dict(KW, tokens=2 * 2 * S))
        train(fresh(target), cache, out_dir=str(tmp_path / "ck2"), **dict(KW, lr=1.0))


def test_cache_reloads_and_holds_the_target(target, cache):
    again = build_cache(None, cache.ids, model_key="tiny", k=8,
                        directory=cache.path.rsplit("/", 1)[0])  # no target needed: reloaded
    assert torch.equal(again.topk_logits, cache.topk_logits)
    with torch.no_grad():
        logits = target(cache.ids[:2]).logits
    assert torch.equal(cache.greedy[:2], logits.argmax(-1))
    assert torch.allclose(cache.lse[:2], torch.logsumexp(logits, -1))
    assert load_cache(cache.path).key == cache.key


def test_data_packs_train_split_only():
    docs = [Doc(f"d/{i}", "ab" * (i + 3)) for i in range(40)]
    kept = list(train_docs(docs))
    assert kept and all(not held_out(d.doc_id) for d in kept) and len(kept) < len(docs)
    seqs = pack(kept, lambda t: [ord(c) for c in t], seq_len=5, tokens=23, eos=0)
    assert seqs.shape == (5, 5) and seqs.dtype == torch.int64
    with pytest.raises(ValueError, match="seq_len"):
        pack(docs, lambda t: [1], seq_len=0, tokens=5)


def test_cli_init_must_name_an_existing_file_before_anything_loads(tmp_path, capsys):
    from trimpass.__main__ import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["train", "--init", str(tmp_path / "missing.safetensors"), "--out", str(out)])
    assert e.value.code == 2 and "argument --init: no such file" in capsys.readouterr().err
    assert not out.exists()
