"""The optional cache of earlier outputs: within its token and index bounds on a long run, the
oldest output out first, forgotten by ``clear``, refused for another vocabulary, without lookup and
as a wrong type; searched beside the request's own text (the longer match wins); in the loop, a
later request keeps more lookup tokens with it than without it, and every output stays the plain
greedy one."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_fused import FAST, MODELS, _decode
from trimpass.hf.output_cache import OutputCache
from trimpass.spec.config import LookupConfig
from trimpass.spec.proposers.lookup import Lookup


def test_the_cache_stays_within_its_bounds_on_a_long_run():
    cache = OutputCache(max_tokens=500, ngram=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        n = int(torch.randint(2, 120, (1,), generator=g))
        cache.add(torch.randint(0, 50, (n,), generator=g).tolist())
        assert cache.tokens <= 500 and len(cache.index) <= 2 * 3 * 500
    assert sum(len(o) for o in cache.outputs.values()) == cache.tokens > 400


def test_the_oldest_output_leaves_first_and_clear_forgets_all():
    cache = OutputCache(max_tokens=10, ngram=2)
    cache.add([1, 2, 3, 4, 5, 6])
    assert cache.propose([9, 1, 2], 3) == ([3, 4, 5], 2)
    cache.add([7, 8, 9, 10, 11, 12])  # 12 tokens held would pass 10: the first output leaves
    assert cache.propose([9, 1, 2], 3) == ([], 0)
    assert cache.propose([0, 8], 2) == ([9, 10], 1)
    cache.clear()
    assert cache.propose([0, 8], 2) == ([], 0) and cache.tokens == 0


def test_the_longer_match_wins_between_the_text_and_earlier_outputs():
    cache = OutputCache(ngram=3)
    cache.add([4, 5, 6, 7, 8])
    text = Lookup(LookupConfig(tokens=3, ngram=3), outputs=cache)
    text.extend([1, 5, 2, 4, 5])  # the text: "5" recurs (then 2); an output: "4 5" (then 6 7 8)
    assert text.propose(10) == ([6, 7, 8], 2)
    text.extend([2, 4])  # the text now repeats "5 2 4" itself: its own match is longer
    assert text.propose(10) == ([5, 2, 4], 3)


def test_bad_caches_are_refused_before_any_compute():
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="OutputCache: max_tokens must be an int >= 1"):
            OutputCache(max_tokens=bad)
    cache = OutputCache()
    cache.bind(100)
    cache.bind(100)
    with pytest.raises(ValueError, match="output_cache: holds ids of a 100-token vocabulary, "
                                         "this model has 200; use one OutputCache per model"):
        cache.bind(200)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="output_cache: a trimpass.OutputCache or None, got str"):
        trimpass.generate(model, ids, 4, output_cache="yes", **FAST)
    with pytest.raises(ValueError, match="output_cache: .* needs lookup on"):
        trimpass.generate(model, ids, 4, lookup=False, output_cache=OutputCache(), **FAST)
    with pytest.raises(ValueError, match=f"holds ids of a 100-token vocabulary, this model has "
                                         f"{V}"):
        trimpass.generate(model, ids, 4, output_cache=cache, **FAST)
    assert not hasattr(model, "_trimpass_fused")


def test_a_later_request_drafts_from_an_earlier_output_and_stays_lossless():
    torch._dynamo.reset()
    torch.manual_seed(3)
    model = MODELS["llama"]().eval()
    ids = torch.randperm(V)[:12].unsqueeze(0)  # no id twice: the prompt alone proposes little
    want = _decode(model, ids, 40)
    cache = OutputCache(max_tokens=1000)

    def kept(**kw):
        before = trimpass.stats(model)["sources"]["lookup"]["accepted"] \
            if hasattr(model, "_trimpass_fused") else 0
        out = trimpass.generate(model, ids, 40, gamma=4, learn_core=64, **kw, **FAST)
        assert torch.equal(out, want)
        return trimpass.stats(model)["sources"]["lookup"]["accepted"] - before

    kept(output_cache=cache)  # the first request fills the cache
    assert cache.tokens == 40
    with_cache, without = kept(output_cache=cache), kept()
    assert with_cache > without, (with_cache, without)
