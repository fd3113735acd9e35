"""LoopStats.merge: runs over more prompts add up as one run (ratios from the summed counts)."""
from trimpass.loops.stats import LoopStats


def test_merge_adds_counts_and_records_and_keeps_a_failure():
    a = LoopStats("a", rounds=4, drafted=4, accepted=1, emitted=5, seconds=0.5,
                  draft_ms_each=[1.0, 2.0], per_round=[1, 2, 1, 1])
    b = LoopStats("b", rounds=6, drafted=6, accepted=5, emitted=11, seconds=1.5, lossless=False,
                  draft_ms_each=[3.0], target_ms_each=[7.0], per_round=[2, 2, 2, 2, 2, 1])
    out = a.merge(b)
    assert out is a and a.name == "a"
    assert (a.rounds, a.drafted, a.accepted, a.emitted, a.seconds) == (10, 10, 6, 16, 2.0)
    assert a.lossless is False  # one lossy prompt makes the whole run lossy
    assert a.draft_ms_each == [1.0, 2.0, 3.0] and a.target_ms_each == [7.0]
    assert a.per_round == [1, 2, 1, 1, 2, 2, 2, 2, 2, 1]
    assert a.mat == 1.6 and a.acceptance == 0.6 and a.tokens_per_s == 8.0  # 16/10, 6/10, 16/2
