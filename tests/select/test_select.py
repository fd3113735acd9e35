"""Static selection: counting and coverage maths, the TPE search against a sweep, cost models,
interop round trips, and every bad input."""
import json

import numpy as np
import pytest
import torch

from trimpass.__main__ import main
from trimpass.isotonic import pav
from trimpass.select import corpora, costmodel, counts, interop, tokenizers, tpe

WORDS = {w: i for i, w in enumerate("abcdefgh")}


def _words(text):
    return [WORDS[w] for w in text.split()]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path / "cache"))


def _corpus(tmp_path, docs, name="c.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n{broken\n")
    return str(p)


def test_counts_and_coverage_on_a_known_corpus(tmp_path):
    # even documents end in 'e', odd ones in 'd': 6 tokens each, 'a' is half of every document
    docs = ["a a a b c " + ("d" if k % 2 else "e") for k in range(200)]
    enc = tokenizers.get(_words, vocab_size=8)
    c = counts.count(enc, _corpus(tmp_path, docs))
    assert c.docs == 200 and c.skipped == 1 and c.reasons == {"malformed JSONL line": 1}
    total = c.train + c.held
    assert total.tolist() == [600, 200, 200, 100, 100, 0, 0, 0]
    # split by whole documents, about one in ten held out
    assert c.held.sum() % 6 == 0 and 5 <= c.held.sum() // 6 <= 50
    rank = counts.ranking(c.train)
    assert rank[:3].tolist() == [0, 1, 2]  # 'a', then the tie 'b'/'c' in id order (stable)
    assert set(rank[3:5].tolist()) == {3, 4} and set(rank[5:].tolist()) == {5, 6, 7}
    curve = counts.coverage_curve(rank, c.held)
    assert curve[0] == pytest.approx(3 / 6) and curve[2] == pytest.approx(5 / 6)
    assert curve[4] == pytest.approx(1.0) and curve[3] < 1.0
    assert counts.ranking(c.train, keep=[7])[:4].tolist() == [7, 0, 1, 2]


def test_cache_makes_the_second_count_instant(tmp_path):
    enc = tokenizers.get(_words, vocab_size=8)
    path = _corpus(tmp_path, ["a b"] * 50)
    first = counts.count(enc, path)
    enc.encode_batch = None  # a second count must not tokenize again
    again = counts.count(enc, path)
    assert np.array_equal(first.train, again.train)


@pytest.fixture(scope="module")
def real_counts(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # not left set for the tests that follow
        mp.setenv("TRIMPASS_CACHE", str(tmp_path_factory.mktemp("c")))
        return counts.count(tokenizers.get("qwen3"), "sharegpt:4000")


def test_tpe_within_half_a_percent_of_the_sweep(real_counts):
    cost = costmodel.FlopsModel.named("qwen2.5-0.5b")
    _, best, _ = tpe.sweep([real_counts], cost, 0.5, 0.9, real_counts.vocab_size)
    sel = tpe.select([real_counts], cost, alpha=0.5, c_min=0.9, trials=100)
    assert sel.trials == 100  # the whole budget was spent, not cut short
    assert sel.utility >= best * 0.995
    _check_selection(sel, [real_counts], [1.0], cost, alpha=0.5, c_min=0.9)


def _check_selection(sel, cs, weights, cost, alpha, c_min):
    """Recompute a selection from the raw counts: its ids are the K most frequent under the mixing
    weights, its coverage and utility are what those ids give on the held-out split."""
    ids = np.asarray(sel.ids)
    assert len(ids) == sel.K == len(np.unique(ids))
    mix = sum(w * c.train / c.train.sum() for w, c in zip(weights, cs, strict=True))
    outside = np.setdiff1d(np.arange(len(mix)), ids)
    assert mix[ids].min() >= mix[outside].max() - 1e-12  # a top-K set under the mixing
    cov = {c.corpus: c.held[ids].sum() / c.held.sum() for c in cs}
    assert sel.coverage == pytest.approx(cov)
    mean = float(np.mean(list(cov.values())))
    assert mean >= c_min
    assert sel.reduction == pytest.approx(float(cost.reduction(sel.K)))
    assert sel.utility == pytest.approx(alpha * mean + (1 - alpha) * sel.reduction)


def test_several_corpora_search_mixing_weights(real_counts, tmp_path):
    enc = tokenizers.get("qwen3")
    code = counts.count(enc, "pydoc")
    cost = costmodel.FlopsModel.named("qwen2.5-0.5b")
    sel = tpe.select([real_counts, code], cost, alpha=0.5, c_min=0.85, trials=30)
    assert sel.trials == 30
    w = [sel.weights["sharegpt:4000"], sel.weights["pydoc"]]
    assert all(0.05 <= x <= 1.0 for x in w)  # the search range of a mixing weight
    _check_selection(sel, [real_counts, code], w, cost, alpha=0.5, c_min=0.85)


def test_flops_model_counts_flops_by_hand():
    m = costmodel.FlopsModel(layers=2, d=4, ffn=8, V=100)
    # a layer: 2 * (4*4^2 + 3*4*8) = 320, two layers 640; the head at K: 2*4*K = 8K; full = 1440
    assert m.reduction(np.array([0, 10, 100])) == pytest.approx([800 / 1440, 720 / 1440, 0.0])
    ks = np.array([16, 100, 1000, 10_000, 100_000])
    red = costmodel.FlopsModel.named("gemma3-270m").reduction(ks)
    assert np.all(np.diff(red) < 0) and red[0] > 0.5


def _isotonic_minmax(y):
    """Isotonic regression by its closed form, fit[i] = max over j <= i of min over k >= i of
    mean(y[j..k]): independent of the pool-adjacent-violators code under test."""
    n = len(y)
    return np.array([max(min(np.mean(y[j:k + 1]) for k in range(i, n)) for j in range(i + 1))
                     for i in range(n)])


def test_measured_cost_model_is_an_isotonic_fit_of_noisy_timings():
    # timed out of order, with two noisy dips (at 1024 and 8192)
    m = costmodel.MeasuredModel.fit(32_768, 64, ks=[4096, 256, 1024, 16_384, 8192],
                                    raw_ms=[3.0, 1.0, 0.8, 6.0, 2.6], full_ms=10.0)
    assert m.ks == [256, 1024, 4096, 8192, 16_384]
    assert m.fit_ms == pytest.approx([0.9, 0.9, 2.8, 2.8, 6.0])  # each dip pooled with its left
    slope = (6.0 - 0.9) / (16_384 - 256)
    ks = np.array([100, 640, 6144, 12_288, 32_768])
    assert m.ms(ks) == pytest.approx([0.9, 0.9, 2.8, 4.4, 6.0 + slope * 16_384])
    assert m.reduction(ks) == pytest.approx(1 - m.ms(ks) / 10.0)
    slow = costmodel.MeasuredModel.fit(32_768, 64, ks=[256, 16_384], raw_ms=[1.0, 6.0],
                                       full_ms=2.0)
    assert slow.reduction(16_384) == pytest.approx(-2.0)  # slower than the full head: not hidden
    # a late low timing pools back through two earlier blocks: 6 with 2, then 5 with both
    assert pav([1.0, 5.0, 6.0, 2.0]) == pytest.approx([1.0, 13 / 3, 13 / 3, 13 / 3])
    for seed in range(5):
        y = np.random.default_rng(seed).normal(size=12)
        assert pav(y) == pytest.approx(_isotonic_minmax(y))


def test_measured_cost_model_on_this_machine_is_monotone_in_k():
    m = costmodel.MeasuredModel.measure(4096, 64, ks=(64, 512, 2048), cache=False)
    assert m.ks == [64, 512, 2048] and min(m.raw_ms) > 0 and m.full_ms > 0
    assert m.fit_ms == pytest.approx(_isotonic_minmax(np.array(m.raw_ms)))
    ks = np.array([16, 64, 100, 512, 1000, 2048, 4096])
    ms = m.ms(ks)  # not clamped: monotone only because the fit is
    assert np.all(np.diff(ms) >= 0) and np.all(np.diff(m.reduction(ks)) <= 0)


def test_interop_round_trips(tmp_path):
    ids = np.array([5, 2, 99, 40])
    interop.export_sglang(ids, tmp_path / "map.pt")
    interop.export_eagle3(ids, 128, tmp_path / "e3.pt")
    torch.save(torch.tensor([99, 5, 2, 40, 7]), tmp_path / "freq_5.pt")
    exp = sorted(ids.tolist())
    assert interop.load_any(tmp_path / "map.pt").tolist() == exp
    assert interop.load_any(tmp_path / "e3.pt").tolist() == exp
    assert interop.load_any(tmp_path / "freq_5.pt", top_k=4).tolist() == [99, 5, 2, 40]
    e3 = torch.load(tmp_path / "e3.pt")
    assert e3["t2d"].shape == (128,) and e3["t2d"].nonzero().flatten().tolist() == exp
    assert e3["d2t"].tolist() == [2, 4, 38, 96]  # EAGLE-3: draft id i is target id i + d2t[i]


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="tokenizer: unknown name 'nope'"):
        tokenizers.get("nope")
    with pytest.raises(corpora.CorpusError, match="not a file"):
        list(corpora.read(str(tmp_path / "missing.txt")))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(corpora.CorpusError, match="no usable text"):
        counts.count(tokenizers.get(_words, vocab_size=8), str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="alpha: must be in"):
        tpe.check_args(1.5, 0.9)
    c = counts.count(tokenizers.get(_words, vocab_size=8), _corpus(tmp_path, ["a b c"] * 40))
    assert 0 < c.held.sum() < 120  # both splits hold copies, wherever tmp_path is
    with pytest.raises(ValueError, match="min coverage: 0.99 is not reached by any K <= 1"):
        tpe.select([c], costmodel.FlopsModel(1, 8, 8, 8), c_min=0.99, k_max=1)
    bad = tokenizers.get(lambda s: [9], vocab_size=8)
    with pytest.raises(ValueError, match="produced id 9"):
        counts.count(bad, _corpus(tmp_path, ["a"] * 20, "d.jsonl"))


def test_cli_select_end_to_end(tmp_path, capsys):
    out = tmp_path / "v.pt"
    rc = main(["select", "--tokenizer", "qwen3", "--corpus", "pydoc", "--min-coverage", "0.8",
               "--trials", "25", "--vocab-size", "151936", "--out", str(out),
               "--export-sglang", str(tmp_path / "sg.pt")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "chosen K" in text and "held-out coverage on pydoc" in text
    ids = torch.load(out)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert torch.equal(interop.load_any(tmp_path / "sg.pt"), ids)
    assert (tmp_path / "v.png").stat().st_size > 1000
    with open(tmp_path / "v.json") as f:
        rep = json.load(f)
    assert rep["K"] == len(ids) and rep["trials"] == 25
    assert rep["heldout_coverage"]["pydoc"] >= 0.8
    rc = main(["select", "--tokenizer", "o200k", "--corpus", "pydoc", "--vocab-size", "151936",
               "--out", str(out)])
    assert rc == 2 and "do not fit a head of 151936 rows" in capsys.readouterr().err
