"""trimpass.serving.head: a batch's trimmed logits with one shared copy, whole and vocab-sharded;
request rows that follow an engine's batch (bound, fed, released, rebuilt from a resumed request's
own tokens), with no engine."""
import pytest
import torch
import torch.nn.functional as F

from trimpass import compact
from trimpass.serving import head


def _rows(V, B, cap, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.zeros(B, cap, dtype=torch.long)
    count = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n = 5 + 7 * b
        idx[b, :n] = torch.randperm(V, generator=g)[:n]
        idx[b, n:] = torch.randint(0, V, (cap - n,), generator=g)  # junk past the count
        count[b] = n
    return idx, count


def _reference(x, W, idx, count, softcap=0.0):
    z = F.linear(x, W)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    out = torch.full_like(z, float("-inf"))
    for b in range(x.shape[0]):
        ids = idx[b, :int(count[b])]
        out[b, ids] = z[b, ids]
    return out


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_rows_get_their_own_ids_exactly(softcap):
    V, d, B = 1000, 32, 4
    x, W = torch.randn(B, d), torch.randn(V, d)
    idx, count = _rows(V, B, 64)
    compact.clear()
    out, U = head.trimmed_logits(x, W, idx, count, softcap=softcap)
    ref = _reference(x, W, idx, count, softcap)
    assert torch.equal(torch.isfinite(out), torch.isfinite(ref))
    torch.testing.assert_close(out[torch.isfinite(ref)], ref[torch.isfinite(ref)])
    assert U == len(set(torch.cat([idx[b, :int(count[b])] for b in range(B)]).tolist()))
    # one compact copy shared by the rows (G = 1), not one per row
    assert [k[5] for k in compact._cache] == [1]


def test_vocab_shards_concatenate_to_the_whole_head():
    """Tensor parallelism by vocabulary: each rank computes its own active ids only; the
    gathered shards (with padding rows, as vLLM pads each shard) equal the unsharded result."""
    V, d, B, P = 1000, 16, 3, 512
    x, W = torch.randn(B, d), torch.randn(V, d)
    idx, count = _rows(V, B, 48, seed=1)
    whole, _ = head.trimmed_logits(x, W, idx, count)
    pad = torch.cat([W, torch.randn(2 * P - V, d)])  # rank 1's shard ends with 24 padding rows
    parts = [head.trimmed_logits(x, pad[r * P:(r + 1) * P].contiguous(), idx, count, start=r * P)
             for r in range(2)]
    gathered = torch.cat([p for p, _ in parts], 1)[:, :V]
    assert torch.equal(gathered, whole)
    assert sum(u for _, u in parts) == head.trimmed_logits(x, W, idx, count)[1]
    assert torch.isneginf(torch.cat([p for p, _ in parts], 1)[:, V:]).all()  # padding stays -inf


def test_static_list_and_plain_head_fallback(monkeypatch):
    V, d, B = 300, 8, 2
    x, W = torch.randn(B, d), torch.randn(V, d)
    ids = torch.tensor([3, 7, 299, 150])
    out, U = head.trimmed_logits(x, W, ids, torch.tensor([4]))
    ref = _reference(x, W, ids.expand(B, -1), torch.tensor([4, 4]))
    assert U == 4 and torch.equal(torch.isfinite(out), torch.isfinite(ref))
    monkeypatch.setattr(head, "MAX_UNION", 2)  # over the bound: the plain head, same result
    out2, _ = head.trimmed_logits(x, W, ids, torch.tensor([4]))
    torch.testing.assert_close(out2, out)


def test_one_bounded_copy_per_head_as_the_union_grows():
    V, d = 5000, 8
    x, W = torch.randn(1, d), torch.randn(V, d)
    compact.clear()
    head._buckets.clear()
    seen = []
    for n in (10, 300, 40, 700, 20):
        idx = torch.randperm(V)[:n][None]
        out, _ = head.trimmed_logits(x, W, idx, torch.tensor([n]))
        assert torch.isfinite(out).sum() == n
        seen.append([k[6] for k in compact._cache])  # the CAP of every cached copy
    assert seen == [[256], [512], [512], [1024], [1024]]  # one copy, grown, never shrunk


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_top_prob_is_each_rows_softmax_maximum(dtype, tol):
    V, d, B = 997, 24, 5
    g = torch.Generator().manual_seed(11)
    x, W = torch.randn(B, d, generator=g).to(dtype), torch.randn(V, d, generator=g).to(dtype)
    idx, count = _rows(V, B, 48, seed=3)
    count[2] = 0  # a row with no active ids: no maximum, 0
    out, _, top = head.trimmed_logits(x, W, idx, count, scale=0.7, with_top=True)
    ref = _reference(x.float(), W.float(), idx, count) * 0.7
    want = torch.softmax(ref, dim=-1).max(dim=-1).values.nan_to_num(0.0)
    assert want[2] == 0 and (want[[0, 1, 3, 4]] > 0).all()
    torch.testing.assert_close(top, want, atol=tol, rtol=tol)
    torch.testing.assert_close(out.float()[torch.isfinite(ref)], ref[torch.isfinite(ref)],
                               atol=5e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def _engine_rows():
    from trimpass.config import TrimConfig
    from trimpass.dynamic.state import ActiveState
    st = ActiveState(TrimConfig(capacity=64, learn_core=0, max_rows=4, escape=None).settings)
    st.build(1000, "cpu")
    return head.RequestRows(st)


def _row_ids(rows, rid):
    st = rows.state
    r = st.requests[rid]
    return set(st.idx[r, :int(st.count[r])].tolist())


def test_request_rows_follow_the_batch_and_never_mix_requests():
    rows = _engine_rows()
    toks = {"a": list(range(100, 110)), "b": list(range(200, 205))}  # disjoint id ranges
    seq = lambda rid: lambda i, lo, hi: torch.tensor(toks[rid][lo:hi])  # noqa: E731
    order = ["a", "b"]
    rows.follow(order, [len(toks[r]) for r in order], lambda i, lo, hi: seq(order[i])(i, lo, hi))
    assert _row_ids(rows, "a") == set(toks["a"]) and _row_ids(rows, "b") == set(toks["b"])
    toks["a"] += [111, 112]  # a gained two tokens
    rows.follow(order, [len(toks[r]) for r in order], lambda i, lo, hi: seq(order[i])(i, lo, hi))
    assert _row_ids(rows, "a") == set(toks["a"])
    order = ["b"]  # a left the batch (finished or preempted)
    rows.follow(order, [len(toks["b"])], lambda i, lo, hi: seq("b")(i, lo, hi))
    assert "a" not in rows.state.requests and rows.live == 1
    order = ["c", "b", "a"]  # a new request takes a's old row; a resumes in another
    toks["c"] = list(range(300, 303))
    rows.follow(order, [len(toks[r]) for r in order], lambda i, lo, hi: seq(order[i])(i, lo, hi))
    for rid in order:
        assert _row_ids(rows, rid) == set(toks[rid]), rid
    rows.follow([], [], None)
    assert rows.live == 0


def test_ids_outside_the_vocabulary_are_left_to_the_engine():
    rows = _engine_rows()  # V = 1000; an engine that skips its own prompt check passes these on
    toks = [5, 1000, 7, -1, 123456]
    rows.follow(["a"], [len(toks)], lambda i, lo, hi: torch.tensor(toks[lo:hi]))
    assert _row_ids(rows, "a") == {5, 7}
    toks += [2000, 9]
    rows.follow(["a"], [len(toks)], lambda i, lo, hi: torch.tensor(toks[lo:hi]))
    assert _row_ids(rows, "a") == {5, 7, 9}


def test_keep_only_releases_the_rows_of_requests_that_left():
    rows = _engine_rows()
    rows.follow(["a", "b", "c"], [2, 2, 2], lambda i, lo, hi: torch.tensor([10 * i, 10 * i + 1]))
    rows.keep_only(["b"])
    assert set(rows.state.requests) == {"b"} and rows.admitted.keys() == {"b"}
    rows.keep_only([])
    assert rows.live == 0


def _eagle3_reference(x, W_draft, d2t, V):
    """vLLM 0.32's ``Eagle3LlamaForCausalLM.compute_logits``: the draft head's logits placed at
    target ids ``i + d2t[i]``, ``-inf`` elsewhere."""
    z = F.linear(x, W_draft)
    out = torch.full((x.shape[0], V), float("-inf"))
    out[:, torch.arange(d2t.numel()) + d2t] = z
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_draft_vocabulary_trims_inside_itself(dtype, tol):
    """An EAGLE-3 head over 301 of 997 target ids: each row finite exactly on its active ids
    inside the draft vocabulary, equal there to the untrimmed head's mapped logits; active ids
    outside it stay -inf, as the untrimmed head leaves them."""
    V, Vd, d, B = 997, 301, 24, 5
    g = torch.Generator().manual_seed(1)
    targets = torch.randperm(V, generator=g)[:Vd].sort().values
    d2t = targets - torch.arange(Vd)
    x, W = torch.randn(B, d, generator=g).to(dtype), torch.randn(Vd, d, generator=g).to(dtype)
    idx, count = _rows(V, B, 80, seed=2)
    vocab = head.DraftVocab(d2t, V)
    compact.clear()
    local, _ = head.trimmed_logits(x, W, vocab.to_draft(idx), count)
    got = vocab.to_target(local)
    ref = _eagle3_reference(x.float(), W.float(), d2t, V)
    inside = set(targets.tolist())
    for b in range(B):
        ids = [i for i in idx[b, :int(count[b])].tolist() if i in inside]
        assert len(ids) < int(count[b])  # the row also holds ids the head cannot score
        finite = torch.isfinite(got[b]).nonzero().reshape(-1)
        assert finite.tolist() == sorted(ids)
        torch.testing.assert_close(got[b, ids].float(), ref[b, ids], atol=tol, rtol=tol)


def test_a_draft_vocabulary_map_outside_the_target_or_not_one_to_one_is_refused():
    with pytest.raises(ValueError, match="draft id 2 maps to target id 10, outside"):
        head.DraftVocab(torch.tensor([0, 0, 8]), 10)
    with pytest.raises(ValueError, match="two draft ids map to the same target id"):
        head.DraftVocab(torch.tensor([1, 0, 0]), 10)
    v = head.DraftVocab(torch.tensor([2, 3, 3]), 10)  # target ids 2, 4, 5
    assert v.to_draft(torch.tensor([[2, 3, 4, 5, -1, 12]])).tolist() == [[0, -1, 1, 2, -1, -1]]


def test_a_static_list_composes_with_a_draft_vocabulary():
    """One static list for every row (target ids): each row finite on the list's ids inside the
    draft vocabulary, -inf on the rest of the list."""
    V, Vd, d, B = 50, 20, 8, 3
    targets = torch.arange(0, 40, 2)  # the even ids below 40
    vocab = head.DraftVocab(targets - torch.arange(Vd), V)
    x, W = torch.randn(B, d), torch.randn(Vd, d)
    static = torch.tensor([1, 2, 3, 4, 41, 42])
    local, U = head.trimmed_logits(x, W, vocab.to_draft(static), torch.tensor(len(static)))
    got = vocab.to_target(local)
    assert U == 2
    for b in range(B):
        assert torch.isfinite(got[b]).nonzero().reshape(-1).tolist() == [2, 4]
        torch.testing.assert_close(got[b, [2, 4]], x[b] @ W[[1, 2]].T)
