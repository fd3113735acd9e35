"""The price records (trimpass.spec.control.prices): one per source, P(position accepted | reached)
by match length and position with a Beta prior, learned from any draft against the tokens the
target emitted; a bad prior and bad lookup settings are refused by name."""
import math

import pytest

from trimpass.spec.control.policies import check_settings
from trimpass.spec.control.prices import PriceRecord, agreement

G = 4


def test_the_price_is_per_match_length_and_position_from_what_was_accepted():
    p = PriceRecord(G, rows=5)
    assert p.confidences([3, 0], [2, 0], G).tolist() == [[0.5, 0.5, 0.5, 0.0], [0] * G]
    for _ in range(8):
        p.observe(1, kept=0, reached=1)  # short matches: rejected at once
        p.observe(4, kept=4, reached=4)  # long matches: all accepted
    c = p.confidences([4, 4, 2], [1, 9, 4], G)
    # each cell's prior, worth 2 observations, is the other match lengths' record there: at
    # position 0, match 1's is match 4's (8 + 1) / (8 + 2), so (0 + 2 x 0.9) / (8 + 2); match
    # 4's is match 1's (0 + 1) / (8 + 2), so (8 + 2 x 0.1) / (8 + 2)
    assert c[0, 0] == pytest.approx(0.18) and c[1, 0] == pytest.approx(0.82)
    # later positions, reached by match 4 alone: match 1, never reached there, starts from what
    # match 4 did, (8 + 1) / (8 + 2); match 4 from the prior, (8 + 2 x 0.5) / (8 + 2)
    assert c[0, 1:].tolist() == pytest.approx([0.9] * 3)
    assert c[1, 1:].tolist() == pytest.approx([0.9] * 3)
    assert c[1].tolist()[:2] == c[2].tolist()[:2]  # 9 pools at 4
    assert c[2, 2:].tolist() == [0.0, 0.0]  # past its draft
    assert p.row(99).tolist() == p.row(4).tolist()
    assert PriceRecord(G, rows=5).row(2).tolist() == [0.5] * G  # nothing seen: the prior


def test_agreement_knows_only_the_positions_the_target_emitted():
    assert agreement([5, 6, 7, 9], [5, 6, 7, 8, 2]) == (3, 4)  # parts at the fourth
    assert agreement([5, 6], [5, 6, 7]) == (2, 2)  # all kept
    assert agreement([5, 6, 7, 8], [5, 6]) == (2, 2)  # agrees as far as the target went
    assert agreement([4], [5, 6]) == (0, 1)  # the first differs
    assert agreement([4, 5], []) == (0, 0)


@pytest.mark.parametrize("prior", [(0, 1), (-1.0, 1.0), (math.inf, 1.0), (1.0, math.nan)])
def test_a_bad_prior_is_refused_by_name(prior):
    with pytest.raises(ValueError, match="price prior"):
        PriceRecord(G, prior=prior)


@pytest.mark.parametrize("lookup, match", [
    ({"ngram": 0}, "budget lookup ngram"), ({"ngram": 2.5}, "budget lookup ngram"),
    ({"ngram": True}, "budget lookup ngram"), ({"tokens": G + 1}, "num_speculative_tokens"),
    ({"tokens": 0}, "budget lookup tokens"), ({"size": 3}, "unknown setting 'size'"),
    ("yes", "budget lookup: true, false or a dict")])
def test_bad_lookup_settings_are_refused_by_name(lookup, match):
    with pytest.raises(ValueError, match=match):
        check_settings({"policy": "dcut", "lookup": lookup}, G)


def test_lookup_is_on_by_default_where_the_policy_prices_drafts_and_refused_where_not():
    assert check_settings({"policy": "dcut"}, G)["lookup"] == {"ngram": 4, "tokens": G}
    assert check_settings({"policy": "fixed", "gamma": 2}, G)["lookup"] is None
    with pytest.raises(ValueError, match="does not price drafts"):
        check_settings({"policy": "fixed", "gamma": 2, "lookup": True}, G)
