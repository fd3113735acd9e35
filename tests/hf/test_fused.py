"""trimpass.generate, the fused loop: greedy output identical to the same body decoding plainly
and to Hugging Face's ``model.generate``, with the trimmed head run on every draft step (this fails
under ``TRIMPASS_DISABLE=1``) and rollbacks exercised past Gemma's sliding window; sampling checked
by a chi-square test against the model's exact distribution; EOS; bad input before any compute."""
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

import trimpass
from tests.graph.test_hf import SMALL, V
from tests.hf.test_selfdraft import MODELS, _tensors
from trimpass.testing.checks import head_runs

FAST = dict(inner="aot_eager")
WINDOW = dict(MODELS, gemma3=lambda: Gemma3ForCausalLM(Gemma3TextConfig(
    **SMALL, head_dim=16, sliding_window=8, eos_token_id=None, bos_token_id=None)))


def _decode(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0, **kw)


@pytest.mark.parametrize("name", list(WINDOW))
@pytest.mark.parametrize("vocab", ["static", "dynamic"])
def test_greedy_is_the_plain_models_output_with_the_trimmed_head_drafting(name, vocab):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WINDOW[name]().eval()
    ids = torch.randint(0, V, (1, 7))
    settings = dict(vocab=torch.randperm(V)[:300]) if vocab == "static" else dict(learn_core=64)
    alone = dict(lookup=False)  # the trimmed head drafts every round (lookup: test_lookup.py)
    got = trimpass.generate(model, ids, 40, gamma=4, confidence=0.0, **alone, **settings, **FAST)
    loop = model._trimpass_fused
    assert _tensors(loop.step) <= _tensors(model)  # the model's own tensors, none copied
    before = trimpass.stats(model)
    with head_runs(loop.step) as runs:  # a second call: every step's head trimmed
        again = trimpass.generate(model, ids, 40, gamma=4, confidence=0.0, **alone, **settings,
                                  **FAST)
    runs.check()
    st = trimpass.stats(model)  # the prefill and every body step ran the drafting step
    assert st["trimmed_calls"] == st["body_steps"]
    # and the prefill; a free draft's pass (the suffix index's, here) runs no head
    assert runs.calls == st["body_steps"] - before["body_steps"] + 1
    assert st["rounds"] > 0
    if vocab == "static":  # 300 of 1,000 ids: drafts miss, and the cache rolls back
        assert st["accepted"] < st["drafted"] - 10
    plain = trimpass.generate(model, ids, 40, speculate=False, **settings, **FAST)
    assert torch.equal(got, again) and torch.equal(got, plain)
    assert torch.equal(got, _decode(model, ids, 40))  # fp32, tiny: no near-tie flips here


def test_bf16_is_bit_for_bit_the_plain_loop():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = WINDOW["gemma3"]().eval().to(torch.bfloat16)
    ids = torch.randint(0, V, (1, 5))
    got = trimpass.generate(model, ids, 48, gamma=6, confidence=0.0, vocab=torch.arange(200),
                            **FAST)
    plain = trimpass.generate(model, ids, 48, speculate=False, **FAST)
    assert torch.equal(got, plain)


def test_the_confidence_gate_cuts_rounds_short():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 7))
    trimpass.generate(model, ids, 24, gamma=6, confidence=0.0, learn_core=64, **FAST)
    full = trimpass.stats(model)
    trimpass.generate(model, ids, 24, gamma=6, confidence=0.999, learn_core=64, **FAST)
    gated = trimpass.stats(model)
    full, gated = full["sources"]["self"], gated["sources"]["self"]  # the trimmed head's rounds
    # a round's depth is fixed before it runs, from the last rounds' stops: one row a round
    # once the gate has stopped at the first draft (the first round knew no stop yet)
    assert full["drafted"] / full["rounds"] > 2 and gated["drafted"] <= gated["rounds"] + 6


def test_it_stops_at_eos_as_generate_does():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["qwen2"]().eval()
    ids = torch.randint(0, V, (1, 6))
    free = _decode(model, ids, 20)
    model.generation_config.eos_token_id = int(free[0, 6 + 5])  # its 6th new token
    want = _decode(model, ids, 20)
    got = trimpass.generate(model, ids, 20, gamma=4, confidence=0.0, learn_core=64, **FAST)
    assert torch.equal(got, want) and got.shape[1] <= 6 + 6


def test_disabled_it_decodes_plainly_with_the_full_head(monkeypatch):
    monkeypatch.setenv("TRIMPASS_DISABLE", "1")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    ids = torch.randint(0, V, (1, 7))
    got = trimpass.generate(model, ids, 10, **FAST)
    st = trimpass.stats(model)
    assert (st["trimmed_calls"], st["rounds"], st["verifications"]) == (0, 0, 10)
    assert torch.equal(got, _decode(model, ids, 10))


BAD = [
    (dict(max_new_tokens=0), "max_new_tokens: tokens to generate, an int >= 1"),
    (dict(do_sample=True, temperature=0.0), "temperature: must be > 0 when sampling"),
    (dict(do_sample=True, top_p=0.0), r"top_p: a probability in \(0, 1\]"),
    (dict(do_sample=True, top_p=1.5), r"top_p: a probability in \(0, 1\]"),
    (dict(top_k=0), "top_k: ids kept for sampling"),
    (dict(input_ids=torch.randint(0, V, (2, 5))), "input_ids: .* got a batch of 2"),
    (dict(input_ids=torch.randint(0, V, (5,))), r"input_ids: expected integer ids \[batch"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1]])), "attention_mask: .* unpadded prompt"),
    (dict(gamma=0), "gamma: tokens drafted per verification"),
    (dict(confidence=1.0), r"confidence: .* in \[0, 1\)"),
    (dict(capacity=-1), "capacity"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_input_fails_before_any_compute(kw, msg):
    model = MODELS["llama"]().eval()
    args = dict(input_ids=torch.randint(0, V, (1, 5)), max_new_tokens=4, **FAST)
    with pytest.raises((ValueError, trimpass.TrimpassError), match=msg):
        trimpass.generate(model, **{**args, **kw})
    assert not hasattr(model, "_trimpass_fused")


def test_models_it_cannot_serve_are_named():
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(TypeError, match="model: expected a Hugging Face causal LM"):
        trimpass.generate(torch.nn.Linear(4, 4), ids, 4)
    other = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    other.lm_head = torch.nn.Linear(64, V + 5, bias=False)
    with pytest.raises(ValueError, match=f"head has {V + 5} rows but its input embedding {V}"):
        trimpass.generate(other, ids, 4)
    bodiless = MODELS["llama"]().eval()
    bodiless.base_model_prefix = "nowhere"
    with pytest.raises(ValueError, match="has no base model under its base_model_prefix"):
        trimpass.generate(bodiless, ids, 4)


def _exact_marginals(model, ids, steps, warp):
    """The model's own distribution of each of its first ``steps`` sampled tokens, summed over
    every path (a tiny vocabulary: all paths in one batch per step)."""
    Vs = model.config.vocab_size
    paths, weight, out = ids, torch.ones(1, dtype=torch.float64), []
    with torch.no_grad():
        for _ in range(steps):
            z = model(paths).logits[:, -1].float()
            p = torch.softmax(warp(None, z), -1).double()
            joint = weight[:, None] * p
            out.append(joint.sum(0))
            paths = torch.cat([paths.repeat_interleave(Vs, 0),
                               torch.arange(Vs).repeat(paths.shape[0])[:, None]], 1)
            weight = joint.flatten()
    return out


def peaked_llama(Vs: int):
    """A one-layer Llama over ``Vs`` ids whose distributions are peaked enough for drafts to be
    kept often, with no EOS (every path runs all its tokens)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=Vs, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1)).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


def test_sampling_emits_the_models_own_distribution():
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    from trimpass.testing.stats import chi_square_p
    Vs, n, steps = 16, 1500, 3
    model = peaked_llama(Vs)
    ids = torch.randint(0, Vs, (1, 4))
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(10)])
    want = _exact_marginals(model, ids, steps, warp)
    active = torch.arange(0, Vs, 2)  # the drafter proposes even ids only
    got = torch.stack([trimpass.generate(model, ids, steps, do_sample=True, temperature=0.8,
                                         top_k=10, vocab=active, gamma=3, confidence=0.0,
                                         **FAST)[0, 4:] for _ in range(n)])
    st = trimpass.stats(model)
    assert 0.2 < st["acceptance"] < 0.95  # drafts kept and rejected: both paths ran
    for j in range(steps):
        counts = torch.bincount(got[:, j], minlength=Vs)
        assert chi_square_p(counts, want[j]) > 1e-3, f"token {j}"
    odd = torch.zeros(Vs, dtype=torch.float64)
    odd[active] = want[1][active]  # what a loop that never resampled outside the drafter's ids
    assert chi_square_p(torch.bincount(got[:, 1], minlength=Vs), odd) < 1e-6  # would emit


def test_a_family_the_loop_does_not_own_runs_assisted_generation_with_one_warning():
    from transformers import MistralConfig, MistralForCausalLM
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**SMALL)).eval()
    ids = torch.randint(0, V, (1, 9))
    with pytest.warns(UserWarning, match="does not own mistral models yet .*GPT-2, Gemma-3, "
                                         "Llama, Qwen2.*assisted generation"):
        got = trimpass.generate(model, ids, 12, **FAST)
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(got, want) and not hasattr(model, "_trimpass_fused")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        trimpass.generate(model, ids, 4, **FAST)
    with pytest.raises(trimpass.TrimpassError, match="output_cache: mistral runs"):
        trimpass.generate(model, ids, 4, output_cache=trimpass.OutputCache(), **FAST)
    assert trimpass.warm_up(model, **FAST) > 0  # its assistant's graphs, not a fused loop's
    assert trimpass.warm_up(model, **FAST) == 0.0 and not hasattr(model, "_trimpass_fused")
    assert len(model.state_dict()) == len(MistralForCausalLM(MistralConfig(**SMALL)).state_dict())
