"""trimpass.train.compare: the paired bootstrap covers the true mean difference at about its level
and is exact for a constant difference; E[L] from the formulas is gamma under sampling when the
drafter is the target (a full-vocabulary cache) and falls for a worse drafter."""
import pytest
import torch

from trimpass.train.compare import paired_bootstrap


def test_paired_bootstrap_covers_the_true_difference_at_its_level():
    g = torch.Generator().manual_seed(0)
    covered = 0
    for rep in range(200):
        base = torch.randn(30, generator=g) * 3  # shared per-prompt difficulty: pairing cancels it
        a = base + 0.3 * torch.randn(30, generator=g)
        b = base + 0.5 + 0.3 * torch.randn(30, generator=g)
        m, lo, hi = paired_bootstrap(a, b, resamples=1000, seed=rep)
        covered += lo <= 0.5 <= hi
        assert lo <= m <= hi
        assert hi - lo < 0.6  # unpaired, the spread of `base` would make it ~3
    assert 0.88 <= covered / 200 <= 0.995, covered


def test_paired_bootstrap_constant_difference_and_bad_input():
    assert paired_bootstrap([1.0, 2.0, 4.0], [1.5, 2.5, 4.5]) == pytest.approx((0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap([1.0, 2.0], [1.0])


def test_expected_lengths_is_gamma_for_the_target_itself(tmp_path):
    pytest.importorskip("transformers")
    from tests.train.conftest import tiny
    from trimpass.models import drafter_from
    from trimpass.train.cache import build_cache
    from trimpass.train.compare import expected_lengths
    t = tiny(layers=2, vocab=64)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    cache = build_cache(t, ids, model_key="tiny-el", k=64, directory=str(tmp_path))
    same = expected_lengths(drafter_from(t, 2), cache, gamma=3)
    assert same["sampling"] == pytest.approx(3.0, abs=1e-4)
    worse = expected_lengths(drafter_from(t, 1), cache, gamma=3)
    assert worse["sampling"] < 2.9 and worse["greedy"] < same["greedy"]
