"""The suffix index: its matches equal a brute-force search (every length, every position, across
texts and after compaction), its drafts equal a brute-force vote over the continuations, earlier
outputs stay within the byte cap over a 10,000-request stream (its count of its own arrays checked
against what the process allocated), the least recently used output leaves first, a tenant's
outputs never draft for another tenant (unless shared, where the same canary does), and bad
settings are refused by name."""
import random
import tracemalloc

import numpy as np
import pytest

from trimpass.spec.config import SuffixConfig
from trimpass.spec.proposers.arena import WALK, Arena, vote
from trimpass.spec.proposers.suffix import SuffixProposer, SuffixStore


def _brute_matches(texts, tail, depth):
    """(text index, position after the match, match length) of every place in ``texts`` whose
    preceding tokens match ``tail``'s end by at least 2."""
    out = []
    for k, t in enumerate(texts):
        for p in range(1, len(t) + 1):
            n = 0
            while n < min(depth, p, len(tail)) and t[p - 1 - n] == tail[-1 - n]:
                n += 1
            if n >= 2:
                out.append((k, p, n))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_matches_equal_a_brute_force_search(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])
    texts = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 61))] for _ in range(3)]
    arena = Arena(capacity=17)  # grows (and rechains) on the way
    for k, t in enumerate(texts):
        arena.open(k)
        arena.extend(t[:len(t) // 2])
        arena.extend(t[len(t) // 2:])
        arena.close()
    starts = arena.starts
    for compact in (False, True):
        a = Arena.compacted(arena.texts()) if compact else arena
        for _ in range(20):
            tail = np.array([rng.randrange(vocab) for _ in range(rng.randrange(2, 30))],
                            dtype=np.int32)
            depth = rng.choice([3, 8, 64])
            want = _brute_matches(texts, tail.tolist(), depth)
            at, lengths = a.candidates(tail, depth)
            if len(want) > WALK // 2:
                continue  # a chain walks its newest WALK occurrences only
            longest = max((n for *_, n in want), default=0)
            assert int(lengths.max(initial=0)) == longest
            places = sorted((k, p) for k, p, n in want if n == longest)
            s = a.starts if compact else starts
            got = sorted((int(np.searchsorted(s, q, "right")) - 1,
                          int(q - s[np.searchsorted(s, q, "right") - 1]))
                         for q in at[lengths == longest])
            assert got == places


def test_the_vote_takes_the_most_common_continuation_and_its_share():
    a = Arena()
    for k, t in enumerate([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 5, 6], [9, 1, 2, 7]]):
        a.open(k)
        a.extend(t)
        a.close()
    at, lengths = a.candidates(np.array([0, 1, 2, 3], dtype=np.int32), 64)
    assert sorted(lengths.tolist()) == [3, 3, 3]
    ids, probs = vote([(a, at, 0)], 5, 0.1)
    assert ids == [5, 6] and probs == pytest.approx([2 / 3, 1 / 2])
    assert vote([(a, at, 0)], 5, 0.5)[0] == [5]  # 2/3 * 1/2 falls below 0.5
    # a request's own text repeating itself: its continuation wraps back (the period)
    own = Arena()
    own.open("r")
    own.extend([4, 7, 8, 4, 7, 8, 4, 7])
    at, lengths = own.candidates(own.tokens[:own.used], 64, end_excluded=own.used)
    assert vote([(own, at[lengths == lengths.max()], 1)], 6, 0.1)[0] == [8, 4, 7, 8, 4, 7]


def _store_stream(store, requests, rng):
    for r in range(requests):
        store.add(f"t{r % 13}", rng.integers(0, 50_000, int(rng.integers(2, 700))))
        assert store.nbytes <= store.max_bytes


def test_the_store_stays_within_its_byte_cap_on_a_10000_request_stream():
    cap = 2 << 20
    store = SuffixStore(max_bytes=cap)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _store_stream(store, 10_000, rng)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    counted = store.nbytes
    assert counted <= cap and store.evicted > 5000 and len(store) > 100
    # what the store counts of its own arrays is what the process holds for it, give or take its
    # Python bookkeeping (text starts, keys, the eviction order: tens of bytes a text)
    assert counted <= grown <= counted + 200 * len(store) + (64 << 10), (counted, grown)


def test_the_least_recently_used_output_leaves_first():
    store = SuffixStore(max_bytes=Arena.bytes_for(6100))
    prop = SuffixProposer(SuffixConfig(), store)
    store.add("", range(10_000, 13_000))
    store.add("", range(20_000, 23_000))
    # a request drafts from the older output: it becomes the most recently used
    text = [5, 6, 10_100, 10_101, 10_102]
    d = prop.draft(["q"], [4], lambda i, a, b: text[a:b], [text[4:]], 15)
    assert d.row(0)[:3] == [10_103, 10_104, 10_105]
    store.add("", range(30_000, 31_000))  # past the cap: the least recently used leaves
    kept = {int(t) // 10_000 for _, seq in store.arenas[""].texts() for t in seq}
    assert 1 in kept and 2 not in kept and 3 in kept


def _canary_drafts(share: bool):
    """Tenant "a" keeps an output of canary ids; tenant "b" asks with the same context; the ids
    b is offered."""
    store = SuffixStore(share=share)
    canary = list(range(40_000, 40_030))
    store.add("a", [11, 12, 13, 14] + canary)
    text = [1, 11, 12, 13, 14]
    out = set()
    for tenant in ("b", ""):
        prop = SuffixProposer(SuffixConfig(), store, tenant)
        out |= set(prop.draft(["q"], [4], lambda i, a, b: text[a:b], [text[4:]], 15).ids)
    a_itself = SuffixProposer(SuffixConfig(), store, "a")
    mine = a_itself.draft(["q"], [4], lambda i, a, b: text[a:b], [text[4:]], 15).ids
    return out, set(canary), set(mine)


def test_a_tenants_outputs_never_draft_for_another_tenant():
    offered, canary, own = _canary_drafts(share=False)
    assert own and own <= canary  # the tenant itself drafts from them
    assert not offered & canary
    offered, canary, _ = _canary_drafts(share=True)  # told to share: the same canary does
    assert offered & canary


def test_finished_requests_keep_their_output_for_their_own_tenant_only():
    store = SuffixStore()
    prop = SuffixProposer(SuffixConfig(), store)
    prompt, reply = [7, 8, 9], list(range(500, 540))
    text = prompt + reply
    prop.draft(["x"], [3], lambda i, a, b: text[a:b], [text[3:5]], 15, tenants=["acme"])
    prop.draft(["x"], [5], lambda i, a, b: text[a:b], [text[5:]], 15, tenants=["acme"])
    prop.finish("x")
    assert store.tenants() == ["acme"] and len(prop) == 0
    assert [t.tolist() for _, t in store.arenas["acme"].texts()] == [reply]


@pytest.mark.parametrize("bad, message", [
    (dict(max_bytes=0), "suffix max_bytes: the byte cap .* an int >= 1, got 0"),
    (dict(max_bytes=-5), "suffix max_bytes: .* got -5"),
    (dict(depth=0), "suffix depth: the longest match measured, in tokens, a positive integer"),
    (dict(depth=2.5), "suffix depth: .* got 2.5"),
    (dict(min_match=3, depth=2), r"suffix min_match: at most depth \(2\), got 3"),
    (dict(tokens=True), "suffix tokens: .* got True"),
    (dict(min_prob=1.0), r"suffix min_prob: .* in \[0, 1\)"),
    (dict(share="yes"), "suffix share: True .* got 'yes'"),
])
def test_bad_settings_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        SuffixConfig(**bad)
    if set(bad) <= {"max_bytes", "share"}:
        with pytest.raises(ValueError, match=message):
            SuffixStore(**bad)


def test_a_tenant_that_is_not_a_string_is_refused():
    store = SuffixStore()
    for bad in (5, None, b"a"):
        with pytest.raises(ValueError, match="tenant: a string naming whose earlier outputs"):
            store.add(bad, [1, 2, 3])
        with pytest.raises(ValueError, match="tenant: a string"):
            SuffixProposer(SuffixConfig(), store, bad)
