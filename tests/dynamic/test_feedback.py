"""trimpass.pair (target feedback): a target pass admits its top-k ids at every position into the
paired drafter's row, and the drafter's next output is exact there; unpairing stops it; another
drafter never sees them; nothing happens before the drafter's first call; HF assisted generation
stays lossless with the trimmed head on every call; bad input."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trimpass
from trimpass.config import TrimpassError
from trimpass.hf import assisted
from trimpass.testing.checks import head_runs
from trimpass.testing.models import Transformer

V = 512
CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
           pad_token_id=0)


def _drafter(seed):
    torch.manual_seed(seed)
    m = Transformer(V, tied=True).eval()
    m.setup_caches(1, 64)
    return m


def _active(c) -> set:
    return set(trimpass.active_ids(c)[0, :trimpass.stats(c)["active"][0]].tolist())


def test_a_target_pass_feeds_its_top_k_into_the_paired_drafters_row():
    torch._dynamo.reset()
    draft, other = _drafter(0), _drafter(1)
    plain = copy.deepcopy(draft)
    c = trimpass.trim(draft, refresh_every=0, learn_core=0, escape=None, inner="aot_eager")
    c2 = trimpass.trim(other, refresh_every=0, learn_core=0, escape=None, inner="aot_eager")
    target = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    handle = trimpass.pair(target, c, k=4)
    ids = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        target(ids[:, :3])  # before the drafter's first call: no row yet, nothing to feed
        c(ids, torch.arange(6))
        plain.forward(ids, torch.arange(6))  # the reference's cache, filled alike
        c2(ids, torch.arange(6))
        before = _active(c)
        logits = target(ids).logits
        fed = set(logits.topk(4, dim=-1).indices.flatten().tolist())
        assert fed - before, "the target's top-k were already active: the test shows nothing"
        assert fed <= _active(c)
        assert not (fed - before) & _active(c2)  # the unpaired drafter never sees them
        out = c(ids[:, -1:], torch.tensor([6]))
        ref = plain.forward(ids[:, -1:], torch.tensor([6]))
        new = sorted(fed - before)
        assert torch.allclose(out[0, -1, new], ref[0, -1, new], atol=1e-5)
        handle.remove()
        after = _active(c)
        target(torch.randint(0, V, (1, 6)))
        assert _active(c) == after


def test_assisted_generation_with_feedback_is_lossless_and_trimmed():
    torch._dynamo.reset()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**CFG)).double().eval()
    prompts = [torch.randint(1, V, (10,)).tolist() for _ in range(2)]
    _, refs = assisted.run(target, None, prompts, 12, "target alone")
    draft = trimpass.trim(copy.deepcopy(target), escape=None, inner="aot_eager")
    handle = trimpass.pair(target, draft, k=2)
    try:
        with head_runs(draft) as runs:
            st, _ = assisted.run(target, draft, prompts, 12, "trimmed, paired", refs)
    finally:
        handle.remove()
    runs.check()
    assert st.lossless and st.accepted > 0


def test_bad_input():
    torch._dynamo.reset()
    target = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    dyn = trimpass.trim(_drafter(0), inner="aot_eager")
    with pytest.raises(TrimpassError, match="pair: k must be an int >= 1"):
        trimpass.pair(target, dyn, k=0)
    with pytest.raises(TrimpassError, match="pair: target must be an nn.Module"):
        trimpass.pair(lambda x: x, dyn)
    static = trimpass.trim(_drafter(1), vocab=torch.arange(10), inner="aot_eager")
    with pytest.raises(TrimpassError, match="pair: draft has a static vocabulary"):
        trimpass.pair(target, static)
    other = LlamaForCausalLM(LlamaConfig(**{**CFG, "vocab_size": 256})).eval()
    hf_draft = trimpass.trim(LlamaForCausalLM(LlamaConfig(**CFG)).eval(), inner="aot_eager")
    with pytest.raises(TrimpassError, match=r"vocabulary \(256\) differs from the drafter's"):
        trimpass.pair(other, hf_draft)


class _Logits(torch.nn.Module):
    """A target with no output embeddings: pair() cannot check its width before it runs."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, ids):
        return self.out


def test_a_target_whose_output_does_not_fit_fails_at_its_first_pass():
    torch._dynamo.reset()
    c = trimpass.trim(_drafter(2), inner="aot_eager")
    ids = torch.randint(0, V, (1, 4))
    with torch.no_grad():
        c(ids, torch.arange(4))  # the drafter's state exists: the tap reads the target's output
        before = _active(c)
        narrow = _Logits(torch.randn(1, 4, V // 2))
        trimpass.pair(narrow, c)
        with pytest.raises(TrimpassError, match=rf"logits have {V // 2:,} columns, the drafter's "
                                                rf"vocabulary {V:,}"):
            narrow(ids)
        ints = _Logits(torch.zeros(1, 4, V, dtype=torch.long))
        trimpass.pair(ints, c)
        with pytest.raises(TrimpassError, match=r"output has no logits \[B, \.\.\., V\]"):
            ints(ids)
    assert _active(c) == before  # nothing admitted from either
