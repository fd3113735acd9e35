"""trimpass.hf.exact: a bf16 target made row-invariant gives, bit for bit, the same logits when it
verifies k tokens in one pass as k one-token steps do (and the control shows, on a shape where this
machine's plain model is not, that the check can fail); sliding-window masks included; a drafter
sharing its modules runs plain; lossless assisted generation in bf16 against the exact target's own
decoding; bad input."""
import copy

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import trimpass
from trimpass.hf import assisted, exact
from trimpass.hf.gemma import truncated
from trimpass.testing.checks import head_runs

# Gemma-3-270M's layer widths (its down_proj, K = 2,048, is where one-row and multi-row bf16
# kernels round differently), 4 layers, a small vocabulary, a sliding window the prompts exceed
CFG = dict(vocab_size=4096, hidden_size=640, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=16,
           eos_token_id=None, bos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = Gemma3ForCausalLM(Gemma3TextConfig(**CFG)).to(torch.bfloat16).eval()
    made = copy.deepcopy(plain)
    exact.use(made)
    return plain, made


@torch.no_grad()
def _verify_vs_steps(model, prompt: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG["vocab_size"], (1, prompt + k), generator=g)
    cache = DynamicCache(config=model.config)
    model(ids[:, :prompt], past_key_values=cache)
    one_pass = model(ids[:, prompt:], past_key_values=cache).logits[0]
    cache = DynamicCache(config=model.config)
    model(ids[:, :prompt], past_key_values=cache)
    steps = torch.cat([model(ids[:, j:j + 1], past_key_values=cache).logits[0]
                       for j in range(prompt, prompt + k)])
    return one_pass, steps


@pytest.mark.parametrize("prompt,k", [(9, 5), (20, 3), (40, 6)])
def test_one_pass_equals_one_token_steps_bit_for_bit(models, prompt, k):
    _, made = models
    a, b = _verify_vs_steps(made, prompt, k, seed=prompt)
    assert torch.equal(a, b)


# whether the plain model rounds a k-row pass differently from k one-row steps is a property of
# the machine's kernels (ISA, thread count), not of the code: the control searches for a shape
# where this machine shows the difference, and skips where it finds none
CONTROL_SHAPES = [(p, k, s) for p, k in [(9, 5), (20, 3), (40, 6), (13, 8), (31, 4), (17, 7)]
                  for s in range(3)]


def test_the_check_can_fail_on_a_shape_where_the_plain_model_is_not_row_invariant(models):
    plain, made = models
    for prompt, k, seed in CONTROL_SHAPES:
        a, b = _verify_vs_steps(plain, prompt, k, seed)
        if not torch.equal(a, b):
            a, b = _verify_vs_steps(made, prompt, k, seed)
            assert torch.equal(a, b), f"not row-invariant at prompt={prompt}, k={k}, seed={seed}"
            return
    pytest.skip(f"the plain bf16 model is row-invariant on this machine on all "
                f"{len(CONTROL_SHAPES)} shapes tried (threads={torch.get_num_threads()}, "
                f"ISA={torch.backends.cpu.get_cpu_capability()}): the control cannot fail here")


def test_prefill_with_drafts_equals_prefill_then_steps(models):
    """Assisted generation's first target pass is the prompt and the drafts together."""
    _, made = models
    ids = torch.randint(3, CFG["vocab_size"], (1, 30))
    with torch.no_grad():
        together = made(ids, logits_to_keep=5).logits[0]
        cache = DynamicCache(config=made.config)
        first = made(ids[:, :26], past_key_values=cache).logits[0, -1:]
        rest = [made(ids[:, j:j + 1], past_key_values=cache).logits[0] for j in range(26, 29)]
    assert torch.equal(together[:4], torch.cat([first, *rest]))


def test_a_drafter_sharing_its_modules_runs_plain(models):
    plain, made = models
    ids = torch.randint(3, CFG["vocab_size"], (1, 12))
    with torch.no_grad():
        shared = truncated(made, 2)(ids).logits  # made's own first 2 layers and tied head
        reference = truncated(plain, 2)(ids).logits
    assert torch.equal(shared, reference)


def test_assisted_generation_in_bf16_is_lossless_and_trimmed(models):
    torch._dynamo.reset()
    _, made = models
    # within the sliding window: Dynamo cannot compile HF's drafter past it (sdpa or not)
    prompts = [torch.randint(3, CFG["vocab_size"], (n,)).tolist() for n in (5, 8)]
    _, refs = assisted.run(made, None, prompts, 7, "exact target alone")
    draft = truncated(made, 4)  # the target drafting for itself: drafts get accepted
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    trimpass.trim(draft, inner="aot_eager")
    with head_runs(draft) as runs:
        st, _ = assisted.run(made, draft, prompts, 7, "trimmed", refs)
    runs.check()
    assert st.lossless and st.accepted > 0


def test_bad_input():
    fp32 = Gemma3ForCausalLM(Gemma3TextConfig(**{**CFG, "num_hidden_layers": 1})).eval()
    with pytest.raises(ValueError, match="model: row-invariant verification is bf16 only"):
        exact.use(fp32)
    gap = torch.zeros(1, 6)
    gap[0, 2] = float("-inf")  # visible keys 0-1 and 3-5: not one range
    with pytest.raises(ValueError, match="not one contiguous range"):
        exact._visible(gap, 1, 6)


def test_softcapping_and_dropout_are_refused_while_the_model_runs():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    capped = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, attn_logit_softcapping=50.0,
    )).to(torch.bfloat16).eval()
    dropped = Gemma3ForCausalLM(Gemma3TextConfig(**{**CFG, "num_hidden_layers": 1,
                                                    "attention_dropout": 0.1}))
    dropped = dropped.to(torch.bfloat16).train()
    for model in (capped, dropped):
        exact.use(model)
        with pytest.raises(ValueError, match="softcapping and dropout are not supported"):
            model(torch.randint(3, 256, (1, 5)))
        assert not exact._Running.on  # the failed pass left the flag as it found it
