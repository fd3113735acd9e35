"""Static selection: counting and coverage maths, the TPE search against a sweep, cost models,
interop round trips, and every bad input."""
import json
import os

import numpy as np
import pytest
import torch

from trimpass.__main__ import main
from trimpass.select import corpora, costmodel, counts, interop, tokenizers, tpe

WORDS = {w: i for i, w in enumerate("a b c d e f g h".split())}


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
    docs = [f"a a a b c {'d' * 0}".strip() + f" e{'' if k % 2 else ''}" for k in range(200)]
    enc = tokenizers.get(_words, vocab_size=8)
    c = counts.count(enc, _corpus(tmp_path, docs))
    assert c.skipped == 1 and c.reasons == {"malformed JSONL line": 1}
    total = c.train + c.held
    assert total.tolist() == [600, 200, 200, 0, 200, 0, 0, 0]
    rank = counts.ranking(c.train)
    assert rank[0] == 0  # 'a' is the most frequent
    curve = counts.coverage_curve(rank, c.held)
    assert curve[0] == pytest.approx(3 / 6) and curve[3] == pytest.approx(1.0)
    assert counts.ranking(c.train, keep=[7])[0] == 7


def test_cache_makes_the_second_count_instant(tmp_path):
    enc = tokenizers.get(_words, vocab_size=8)
    path = _corpus(tmp_path, ["a b"] * 50)
    first = counts.count(enc, path)
    enc.encode_batch = None  # a second count must not tokenize again
    again = counts.count(enc, path)
    assert np.array_equal(first.train, again.train)


@pytest.fixture(scope="module")
def real_counts(tmp_path_factory):
    os.environ["TRIMPASS_CACHE"] = str(tmp_path_factory.mktemp("c"))
    return counts.count(tokenizers.get("qwen3"), "sharegpt:4000")


def test_tpe_within_half_a_percent_of_the_sweep(real_counts):
    cost = costmodel.FlopsModel.named("qwen2.5-0.5b")
    _, best, _ = tpe.sweep([real_counts], cost, 0.5, 0.9, real_counts.vocab_size)
    sel = tpe.select([real_counts], cost, alpha=0.5, c_min=0.9, trials=100)
    assert sel.trials <= 100
    assert sel.utility >= best * 0.995
    assert sel.coverage["sharegpt:4000"] >= 0.9


def test_several_corpora_search_mixing_weights(real_counts, tmp_path):
    enc = tokenizers.get("qwen3")
    code = counts.count(enc, "pydoc")
    sel = tpe.select([real_counts, code], costmodel.FlopsModel.named("qwen2.5-0.5b"),
                     alpha=0.5, c_min=0.85, trials=30)
    assert set(sel.weights) == {"sharegpt:4000", "pydoc"} and len(sel.coverage) == 2


def test_cost_models_are_monotone_in_k():
    ks = np.array([16, 100, 1000, 10_000, 100_000])
    red = costmodel.FlopsModel.named("gemma3-270m").reduction(ks)
    assert np.all(np.diff(red) < 0) and red[0] > 0.5
    m = costmodel.MeasuredModel.measure(4096, 64, ks=(64, 512, 2048), cache=False)
    assert np.all(np.diff(m.ms(ks)) > 0) and np.all(np.diff(m.reduction(ks)) <= 0)


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
    assert e3["t2d"].sum() == 4 and e3["d2t"].tolist() == [2 - 0, 5 - 1, 40 - 2, 99 - 3]


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
    assert (tmp_path / "v.png").stat().st_size > 1000 and json.load(open(tmp_path / "v.json"))["K"]
    rc = main(["select", "--tokenizer", "o200k", "--corpus", "pydoc", "--vocab-size", "151936",
               "--out", str(out)])
    assert rc == 2 and "do not fit a head of 151936 rows" in capsys.readouterr().err
