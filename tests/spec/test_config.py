"""The speculation core's configs refuse bad input at construction, each with an error naming the
field and what it takes: one test per field. Defaults are written once (each route's own), a dict
with an unknown key is refused by name, and checks that need the engine (a lookup draft longer
than ``num_speculative_tokens``) run when the config meets it."""
import dataclasses

import pytest

from trimpass.spec.config import (
    BudgetConfig,
    GenerateConfig,
    LookupConfig,
    Sampling,
    SelfDraftConfig,
)

NOT_POSITIVE_INTS = (0, -3, 2.0, True, "4", None)


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
def test_gamma(bad):
    with pytest.raises(ValueError, match=r"^gamma: tokens drafted per verification, an int >= 1"):
        GenerateConfig(gamma=bad)
    with pytest.raises(ValueError, match=r"^gamma: "):
        SelfDraftConfig(gamma=bad)


@pytest.mark.parametrize("bad", (-0.1, 1.0, 1.5, True, "0.4", None))
def test_confidence(bad):
    with pytest.raises(ValueError, match=r"^confidence: .* stops, in \[0, 1\) \(0: always gamma "
                                         r"tokens\), got"):
        GenerateConfig(confidence=bad)
    with pytest.raises(ValueError, match=r"^confidence: "):
        SelfDraftConfig(confidence=bad)


@pytest.mark.parametrize("field", ["tokens", "ngram", "min_match", "match_cap"])
@pytest.mark.parametrize("bad", (0, -1, 1.5, False))
def test_lookup_fields(field, bad):
    with pytest.raises(ValueError, match=rf"^lookup {field}: .*a positive integer, got {bad!r}"):
        LookupConfig(**{field: bad})


def test_lookup_min_match_at_most_ngram():
    with pytest.raises(ValueError, match=r"^lookup min_match: at most ngram \(2\)"):
        LookupConfig(ngram=2, min_match=3)


def test_generate_lookup_and_sampling_types():
    with pytest.raises(ValueError, match=r"^lookup: a LookupConfig or None"):
        GenerateConfig(lookup={"tokens": 3})
    with pytest.raises(ValueError, match=r"^lookup tokens: the fused loop needs a number"):
        GenerateConfig(lookup=LookupConfig(tokens=None))
    with pytest.raises(ValueError, match=r"^sampling: a Sampling"):
        GenerateConfig(sampling={"do_sample": True})


@pytest.mark.parametrize("bad", (16, 0, -1, 2.5, "x", None))
def test_generate_of_refuses_a_lookup_it_cannot_take(bad):
    with pytest.raises(ValueError, match=r"^lookup: True .* an int in \[1, 15\]; got"):
        GenerateConfig.of(lookup=bad)


@pytest.mark.parametrize("bad", ("yes", 2.5, [3]))
def test_a_lookup_of_another_type_is_refused(bad):
    with pytest.raises(ValueError, match=r"^lookup: True, False, a number of tokens, a dict"):
        LookupConfig.of(bad)


def test_a_dict_with_an_unknown_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^lookup: unknown setting 'ngrams'; use tokens, ngram"):
        LookupConfig.of({"ngrams": 3})
    with pytest.raises(ValueError, match=r"^budget: unknown setting 'polcy'; use policy, gamma"):
        BudgetConfig.of({"polcy": "dcut"})
    with pytest.raises(ValueError, match=r"^budget lookup: unknown setting 'n'; use tokens"):
        BudgetConfig.of({"lookup": {"n": 3}})
    with pytest.raises(ValueError, match=r"^budget: a dict of policy"):
        BudgetConfig.of(["dcut"])


def test_sampling_fields():
    with pytest.raises(ValueError, match=r"^do_sample: True or False"):
        Sampling(do_sample=1)
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match=r"^temperature: must be > 0 when sampling"):
            Sampling(do_sample=True, temperature=bad)
    Sampling(do_sample=False, temperature=0)  # greedy ignores the temperature, as HF does
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match=r"^top_k: ids kept for sampling"):
            Sampling(top_k=bad)
    for bad in (0, -0.5, 1.5, True):
        with pytest.raises(ValueError, match=r"^top_p: a probability in \(0, 1\] \(None: no "):
            Sampling(top_p=bad)


@pytest.mark.parametrize("name,settings,message", [
    ("policy", {"policy": "dcutt"}, r"^budget policy: 'dcutt' is not one of dcut, "),
    ("gamma", {"policy": "fixed", "gamma": 0}, r"^budget gamma: the fixed policy needs an integer"),
    ("gamma", {"policy": "fixed", "gamma": True}, r"^budget gamma: the fixed policy needs an"),
    ("gamma", {"policy": "dcut", "gamma": 2}, r"^budget gamma: only the fixed policy takes"),
    ("buckets", {"policy": "fixed", "gamma": 2, "buckets": [4]}, r"^budget buckets: only the"),
    ("measure_s", {"measure_s": 0}, r"^budget measure_s: .* in \(0, 30\]"),
    ("measure_s", {"measure_s": 31}, r"^budget measure_s: "),
    ("probe", {"probe": 0}, r"^budget probe: .* in \(0, 1\], got 0"),
    ("probe", {"probe": "1/16"}, r"^budget probe: "),
    ("lookup", {"lookup": "yes"}, r"^budget lookup: true, false or a dict"),
    ("lookup", {"lookup": {"ngram": 0}}, r"^budget lookup ngram: "),
    ("lookup", {"policy": "fixed", "gamma": 2, "lookup": True}, r"does not price drafts"),
])
def test_budget_fields(name, settings, message):
    with pytest.raises(ValueError, match=message):
        BudgetConfig.of(settings)


def test_budget_checks_that_need_the_engine_run_when_it_meets_the_engine():
    cfg = BudgetConfig.of({"lookup": {"tokens": 6}})  # fine alone: the engine is not known yet
    with pytest.raises(ValueError, match=r"^budget lookup tokens: .* 1\.\.4 "
                                         r"\(num_speculative_tokens\), got 6"):
        cfg.for_engine(4)
    assert cfg.for_engine(8)["lookup"] == {"ngram": 4, "tokens": 6}
    with pytest.raises(ValueError, match=r"^budget gamma: the fixed policy needs .* 1\.\.3"):
        BudgetConfig.of({"policy": "fixed", "gamma": 4}).for_engine(3)
    with pytest.raises(ValueError, match=r"^budget gamma: the fixed policy needs .* got None"):
        BudgetConfig.of({"policy": "fixed"}).for_engine(3)  # a missing length: the engine's range
    with pytest.raises(ValueError, match=r"^num_speculative_tokens: D-Cut needs a draft length"):
        BudgetConfig().for_engine(0)


def test_defaults_are_each_routes_own_and_written_once():
    assert (GenerateConfig().gamma, GenerateConfig().confidence) == (8, 0.4)
    assert (SelfDraftConfig().gamma, SelfDraftConfig().confidence) == (16, 0.4)
    assert LookupConfig() == LookupConfig(tokens=15, ngram=4, min_match=1, match_cap=4)
    assert BudgetConfig().for_engine(5)["lookup"] == {"ngram": 4, "tokens": 5}
    assert BudgetConfig(policy="fixed", gamma=2).lookup is None  # off where nothing prices it
    for cfg in (GenerateConfig(), LookupConfig(), BudgetConfig(), SelfDraftConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.gamma = 3  # frozen: a checked config stays checked


def test_budget_policies_are_the_budgets_own():
    from trimpass.spec.config import POLICIES as NAMES
    from trimpass.spec.control.policies import POLICIES
    assert {n: p.reads_confidence for n, p in POLICIES.items()} == NAMES
