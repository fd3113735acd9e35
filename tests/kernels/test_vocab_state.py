"""The Triton admission kernel against its torch reference (differential, under the interpreter)."""
import pytest
import torch

from trimpass.kernels.vocab_state import admit, admit_host, admit_reference, find


def _pool(R, cap, core=()):
    n = len(core)
    b = dict(idx=torch.zeros((R, cap + 1), dtype=torch.long),
             stamp=torch.full((R, cap + 1), -1, dtype=torch.long),
             count=torch.full((R,), n, dtype=torch.int32),
             clock=torch.zeros(1, dtype=torch.long))
    if n:
        b["idx"][:, :n] = torch.tensor(core)
    return b


def _live(b, row):
    return b["idx"][row, :int(b["count"][row])]


def _run_beside_reference(fn, rows, g, B, R, V, cap, S, core, steps):
    """Admit the same random ids with ``fn`` and the reference; compare after every step."""
    got, ref = _pool(R, cap, core), _pool(R, cap, core)
    for step in range(steps):
        ids = torch.randint(0, V // (1 + step % 3), (B, S), generator=g)  # repeats and evictions
        for bufs, admit_fn in ((got, fn), (ref, admit_reference)):
            bufs["clock"].add_(1)
            admit_fn(bufs["idx"], bufs["stamp"], bufs["count"], bufs["clock"], rows, ids,
                     len(core))
        assert torch.equal(got["count"], ref["count"]), f"step {step}: count differs"
        assert torch.equal(got["stamp"][:, :-1], ref["stamp"][:, :-1]), \
            f"step {step}: stamp differs"
        for row in range(R):
            assert torch.equal(_live(got, row), _live(ref, row)), \
                f"step {step}: row {row} differs"
            assert _live(got, row).unique().numel() == int(got["count"][row]), \
                "an id holds two slots"
    return got


@pytest.mark.parametrize("B,R,V,cap,S,core", [(1, 1, 97, 16, 1, ()), (3, 5, 211, 20, 5, (0, 7)),
                                              (2, 3, 60, 8, 13, (3,)), (4, 6, 1000, 64, 33, ())])
def test_kernel_matches_reference_over_many_steps(B, R, V, cap, S, core, monkeypatch):
    from trimpass.kernels import vocab_state
    monkeypatch.setattr(vocab_state, "SEARCH_C", 16)  # several steps of the kernel's row search
    g = torch.Generator().manual_seed(B * 1000 + S)
    rows = torch.randperm(R, generator=g)[:B]  # batch positions bound to scattered pool rows
    k = _run_beside_reference(admit, rows, g, B, R, V, cap, S, core, steps=40)
    assert int(k["count"][rows].min()) == cap, "the test never reached eviction"
    unbound = sorted(set(range(R)) - set(rows.tolist()))
    assert all(int(k["count"][u]) == len(core) for u in unbound), "an unbound row was written"


@pytest.mark.parametrize("B,R,V,cap,S,core", [(1, 1, 97, 16, 1, ()), (3, 5, 211, 20, 5, (0, 7)),
                                              (2, 3, 60, 8, 13, (3,)), (2, 4, 500, 64, 3, ()),
                                              (2, 3, 3000, 256, 64, (1, 2))])
@pytest.mark.parametrize("as_slice", [False, True])
def test_host_admission_matches_reference_over_many_steps(B, R, V, cap, S, core, as_slice):
    g = torch.Generator().manual_seed(B * 100 + S)
    rows = slice(0, B) if as_slice else torch.randperm(R, generator=g)[:B]
    h = _run_beside_reference(admit_host, rows, g, B, R, V, cap, S, core, steps=200)
    assert int(h["count"].max()) == cap, "the test never reached eviction"


def test_find_locates_live_slots_only():
    row = torch.tensor([[5, 9, 2, 7, 0]])
    got = find(row, torch.tensor([3]), torch.tensor([[2, 7, 5, 4, 9]]), chunk=2)
    assert got.tolist() == [[2, -1, 0, -1, 1]]  # 7 sits past the count: not active
