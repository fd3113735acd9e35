"""Hugging Face models built from configs (random weights, no downloads) under the pass, and the
unmodified assisted-generation loop with a trimmed drafter."""
import copy

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import trimpass
from trimpass.testing.checks import head_runs

V = 1000
SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "gemma3-tied-softcap": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**SMALL, "num_key_value_heads": 1}, head_dim=16, final_logit_softcapping=30.0)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_rewritten(name):
    torch.manual_seed(0)
    m = MODELS[name]().eval()
    vocab = torch.randperm(V)[:300]
    ids = torch.randint(0, V, (2, 7))
    be = trimpass.backend(vocab=vocab, inner="inductor" if name == "llama" else "aot_eager")
    with torch.no_grad():
        ref = m(ids).logits
        out = torch.compile(m, backend=be)(ids).logits
    assert be.reports[0].rewritten == ["logits"]
    exp = torch.full_like(ref, float("-inf"))
    exp[..., vocab] = ref[..., vocab]
    assert torch.equal(torch.isneginf(out), torch.isneginf(exp))
    assert torch.allclose(out[..., vocab], exp[..., vocab], atol=1e-5)


class Recorder(LogitsProcessor):
    """Sees every score row the loop samples from: the target's and the assistant's."""

    def __init__(self):
        self.rows = []

    def __call__(self, input_ids, scores):
        self.rows.append(scores.detach().clone())
        return scores


def test_assisted_generation_unmodified_loop_is_lossless_and_trimmed():
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMALL, "vocab_size": 512}, eos_token_id=None, bos_token_id=None,
                      pad_token_id=0)
    target = LlamaForCausalLM(cfg).double().eval()  # float64: no near-ties between verify modes
    ids = torch.randint(1, 512, (1, 12))
    with torch.no_grad():
        ref = target.generate(ids, do_sample=False, max_new_tokens=30)
    produced = ref[0, 12:]
    missing = produced[3]  # one token the target emits is left out: some drafts must be rejected
    vocab = torch.unique(torch.cat([produced, torch.randperm(512)[:100]]))
    vocab = vocab[vocab != missing]
    draft = trimpass.trim(copy.deepcopy(target), vocab=vocab, inner="aot_eager")
    assert draft.__class__ is LlamaForCausalLM  # same module, compiled in place
    target_calls = []
    target.register_forward_hook(lambda *a: target_calls.append(1))
    rec = Recorder()
    with torch.no_grad(), head_runs(draft) as runs:
        out = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30,
                              logits_processor=LogitsProcessorList([rec]))
    assert torch.equal(out, ref), "assisted generation with the trimmed drafter changed the output"
    runs.check()  # the trimmed op ran inside generate, on every drafter call
    assert runs.calls >= 5, "too few drafter calls to mean anything"
    inactive = torch.ones(512, dtype=torch.bool)
    inactive[vocab] = False
    trimmed_rows = [r for r in rec.rows if torch.isneginf(r[:, inactive]).all()]
    assert len(trimmed_rows) >= 5, "no drafter logits with -inf outside the vocabulary were seen"
    assert all(torch.isfinite(r[:, vocab]).all() for r in trimmed_rows)
    assert len(target_calls) <= 0.7 * 30, "the drafter was not useful: too few drafts accepted"
