"""The fused loop's verification: batched greedy decisions equal the one-row product's (near-ties
computed again alone), and speculative sampling's accept / resample rule emits the target's
distribution (a chi-square test, which a rule that skips the resample fails)."""
import torch

from trimpass.spec.verify import greedy, speculative
from trimpass.testing.stats import chi_square_p


class _Head:
    def __init__(self, W):
        self.W, self.calls = W, []

    def __call__(self, h):
        self.calls.append(h.shape[0])
        return torch.nn.functional.linear(h, self.W)


def test_batched_greedy_decisions_are_the_one_row_products():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        W = torch.randn(4099, 48).to(dtype)
        H = torch.randn(7, 48).to(dtype)
        H[3] = H[0]
        W[17] = W[4000] = H[0] * 2  # rows 0 and 3: ids 17 and 4000 tie at the top
        head = _Head(W)
        ids, again = greedy(head, H)
        want = torch.stack([head(H[j:j + 1]).argmax(-1)[0] for j in range(7)])
        assert torch.equal(ids, want)
        assert again >= 2 and head.calls[0] == 7 and head.calls[1:1 + again] == [1] * again


def test_rows_past_the_first_disagreement_are_not_computed_again():
    torch.manual_seed(1)
    W = torch.randn(4099, 48)
    H = torch.randn(7, 48)
    H[5] = H[0]
    W[17] = W[4000] = H[0] * 2  # rows 0 and 5 tie at the top
    head = _Head(W)
    want = torch.stack([head(H[j:j + 1]).argmax(-1)[0] for j in range(7)])
    keep = want[:3].clone()
    drafted = torch.cat([keep, (want[3:6] + 1) % 4099])  # rows 0-2 agree, row 3 does not
    head.calls.clear()
    ids, again = greedy(head, H, drafted)
    assert again == 1 and head.calls == [7, 1]  # row 0 again; row 5, past row 3, not
    assert torch.equal(ids[:4], want[:4])  # the rows the round keeps: exact
    drafted[:] = want[:6]  # every draft agrees: both near-ties are computed again
    head.calls.clear()
    ids, again = greedy(head, H, drafted)
    assert again == 2 and torch.equal(ids, want)


def _direct(p, q, n, gen):
    out = torch.empty(n, dtype=torch.long)
    for i in range(n):
        x = torch.multinomial(q, 1, generator=gen)
        kept, fix = speculative(p[None], q[None], x, generator=gen)
        out[i] = x[0] if kept else fix
    return out


def test_speculative_sampling_emits_the_target_distribution():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(12, generator=gen) * 1.5, 0)
    q = torch.softmax(torch.randn(12, generator=gen) * 1.5, 0)
    q[[2, 5, 9]] = 0  # ids the drafter never proposes: only the resample reaches them
    q /= q.sum()
    got = torch.bincount(_direct(p, q, 6000, gen), minlength=12)
    assert chi_square_p(got, p) > 1e-3
    assert chi_square_p(got, q) < 1e-9  # the test tells the two apart at this count


def test_all_kept_returns_no_token_and_a_rejection_stops_the_row():
    p = torch.tensor([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    n, fix = speculative(p, p.clone(), torch.tensor([1, 1, 0]))
    assert (n, fix) == (3, None)
    q = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    n, fix = speculative(p, q, torch.tensor([1, 0, 0]))  # row 1 drafted an id p gives 0
    assert (n, fix) == (1, 1)
