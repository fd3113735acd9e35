"""The Triton admission kernel against its torch reference (differential, under the interpreter)."""
import pytest
import torch

from trimpass.kernels.vocab_state import admit, admit_reference


def _fresh(B, V, cap, core=()):
    n = len(core)
    b = dict(slot=torch.full((B, V + 1), -1, dtype=torch.int32),
             idx=torch.zeros((B, cap + 1), dtype=torch.long),
             stamp=torch.full((B, cap + 1), -1, dtype=torch.long),
             count=torch.full((B,), n, dtype=torch.int32),
             clock=torch.zeros(1, dtype=torch.long))
    if n:
        b["idx"][:, :n] = torch.tensor(core)
        b["slot"][:, list(core)] = torch.arange(n, dtype=torch.int32)
    return b


@pytest.mark.parametrize("B,V,cap,S,core", [(1, 97, 16, 1, ()), (3, 211, 20, 5, (0, 7)),
                                            (2, 60, 8, 13, (3,)), (4, 1000, 64, 33, ())])
def test_kernel_matches_reference_over_many_steps(B, V, cap, S, core):
    g = torch.Generator().manual_seed(B * 1000 + S)
    k, r = _fresh(B, V, cap, core), _fresh(B, V, cap, core)
    for step in range(40):
        ids = torch.randint(0, V // (1 + step % 3), (B, S), generator=g)  # repeats and evictions
        for bufs, fn in ((k, admit), (r, admit_reference)):
            bufs["clock"].add_(1)
            fn(bufs["slot"], bufs["idx"], bufs["stamp"], bufs["count"], bufs["clock"], ids,
               len(core))
        for name in ("slot", "count", "stamp"):
            assert torch.equal(k[name][:, :-1] if name != "count" else k[name],
                               r[name][:, :-1] if name != "count" else r[name]), \
                f"step {step}: {name} differs"
        n = k["count"]
        for row in range(B):
            assert torch.equal(k["idx"][row, :n[row]], r["idx"][row, :n[row]])
    assert int(k["count"].min()) == cap, "the test never reached eviction"
