"""The suffix index in :func:`trimpass.generate`: a tenant's later request drafts from its earlier
output and stays the plain greedy one (the index's drafts proven to have been verified in that very
call); no id of one tenant's requests is offered to another tenant before that tenant's own text
holds it (and with sharing on, the same canary is); ``forget`` drops a tenant's outputs; a bad
tenant or suffix setting is refused before any compute."""
import pytest
import torch

import trimpass
from tests.graph.test_hf import V
from tests.hf.test_fused import FAST, MODELS, _decode
from trimpass.hf.fused import FusedLoop
from trimpass.spec.proposers.suffix import SuffixProposer

N = 40


class Recording(SuffixProposer):
    """Every draft it offers, beside the ids the request's own text held when it was offered."""
    offered: list = []

    def draft(self, req_ids, lengths, tokens, emitted, limit, tenants=None):
        d = super().draft(req_ids, lengths, tokens, emitted, limit, tenants)
        own = self.live[req_ids[0]]
        Recording.offered.append((self.default_tenant, set(own.tokens[:own.used].tolist()),
                                  set(d.ids)))
        return d


@pytest.fixture
def model(monkeypatch):
    torch._dynamo.reset()
    torch.manual_seed(5)
    monkeypatch.setattr(FusedLoop, "suffix_proposer", Recording)
    Recording.offered = []
    model = MODELS["llama"]().eval()
    model.generation_config.eos_token_id = None  # every request runs its N tokens
    return model


def _suffix(model) -> dict:
    return trimpass.stats(model)["sources"]["suffix"]


def test_a_later_request_of_the_tenant_drafts_from_its_earlier_output_losslessly(model):
    ids = torch.randperm(V)[:12].unsqueeze(0)  # no id twice: the prompt alone proposes little
    want = _decode(model, ids, N)
    first = trimpass.generate(model, ids, N, gamma=4, lookup=False, tenant="acme", **FAST)
    before = _suffix(model)["accepted"]
    again = trimpass.generate(model, ids, N, gamma=4, lookup=False, tenant="acme", **FAST)
    reused = _suffix(model)["accepted"] - before
    other = trimpass.generate(model, ids, N, gamma=4, lookup=False, tenant="globex", **FAST)
    alone = _suffix(model)["accepted"] - before - reused
    assert torch.equal(first, want) and torch.equal(again, want) and torch.equal(other, want)
    assert reused >= N // 2 > alone, (reused, alone)  # its own output drafted, verified, kept


def _leaks(model, share: bool) -> int:
    """Ids offered to tenant b that its own text did not hold, after tenant a's request."""
    g = torch.Generator().manual_seed(1)
    a_ids, b_ids = (torch.randperm(V, generator=g)[:10].unsqueeze(0) for _ in range(2))
    suffix = {"share": share}
    trimpass.generate(model, a_ids, N, gamma=4, lookup=False, tenant="a", suffix=suffix, **FAST)
    a_text = set(a_ids[0].tolist()) | set(trimpass.generate(
        model, a_ids, N, gamma=4, lookup=False, tenant="a", suffix=suffix, **FAST)[0].tolist())
    Recording.offered = []
    b_out = trimpass.generate(model, a_ids, N, gamma=4, lookup=False, tenant="b", suffix=suffix,
                              **FAST)
    trimpass.generate(model, b_ids, N, gamma=4, lookup=False, tenant="b", suffix=suffix, **FAST)
    assert torch.equal(b_out, _decode(model, a_ids, N))
    assert all(t == "b" for t, _, _ in Recording.offered) and Recording.offered
    return sum(len((d - own) & a_text) for _, own, d in Recording.offered)


def test_no_id_of_one_tenants_requests_is_offered_to_another(model):
    assert _leaks(model, share=False) == 0
    assert _leaks(model, share=True) > 0  # told to share, the same canary is offered


def test_forget_drops_a_tenants_outputs(model):
    ids = torch.randperm(V)[:12].unsqueeze(0)
    for tenant in ("a", "b"):
        trimpass.generate(model, ids, 8, gamma=4, tenant=tenant, **FAST)
    store = model._trimpass_suffix[False]
    assert store.tenants() == ["a", "b"]
    trimpass.forget(model, "a")
    assert store.tenants() == ["b"]
    trimpass.forget(model)
    assert store.tenants() == [] and len(store) == 0


def test_a_bad_tenant_or_suffix_setting_is_refused_before_any_compute():
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="tenant: a string naming whose earlier outputs .* got "
                                         "int"):
        trimpass.generate(model, ids, 4, tenant=7, **FAST)
    with pytest.raises(ValueError, match="suffix max_bytes: .* got 0"):
        trimpass.generate(model, ids, 4, suffix={"max_bytes": 0}, **FAST)
    with pytest.raises(ValueError, match="suffix depth: .* got -1"):
        trimpass.generate(model, ids, 4, suffix={"depth": -1}, **FAST)
    with pytest.raises(ValueError, match="suffix: unknown setting 'size'"):
        trimpass.generate(model, ids, 4, suffix={"size": 3}, **FAST)
    with pytest.raises(ValueError, match="tenant: a string"):
        trimpass.forget(model, 3)
    assert not hasattr(model, "_trimpass_fused") and "_trimpass_suffix" not in model.__dict__
