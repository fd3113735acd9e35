"""trimpass.self_drafter: the model drafts for itself in Hugging Face's assisted generation, sharing
every parameter and buffer (no copy), with its own state, hooks and generation config; lossless
with the trimmed head run on every draft call (this fails under ``TRIMPASS_DISABLE=1``), for
Gemma-3, Llama, Qwen2 and GPT-2 (tied and untied heads); bad input before anything is built."""
import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import trimpass
from tests.graph.test_hf import SMALL, V
from trimpass.spec.config import SelfDraftConfig
from trimpass.testing.checks import head_runs

MODELS = {
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=64,
                                                         eos_token_id=None, bos_token_id=None)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "llama-untied": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                               n_positions=128, eos_token_id=None)),
}


def _tensors(m):
    return {id(t) for t in [*m.parameters(), *m.buffers()]}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_drafts_for_itself_losslessly_through_its_trimmed_head(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    before = model.generation_config.to_dict()
    draft = trimpass.self_drafter(model, gamma=3, confidence=0.0, learn_core=64,
                                  inner="aot_eager")
    assert _tensors(draft) == _tensors(model) and len(_tensors(model)) > 0  # shared, not copied
    assert draft.get_output_embeddings().weight is model.get_output_embeddings().weight
    assert "_compiled_call_impl" not in model.__dict__, "the model itself was compiled"
    assert model.generation_config.to_dict() == before
    g = draft.generation_config
    assert (g.num_assistant_tokens, g.assistant_confidence_threshold) == (3, 0.0)
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        plain = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
        with head_runs(draft) as runs:
            got = model.generate(ids, assistant_model=draft, do_sample=False,
                                 max_new_tokens=12, pad_token_id=0)
    runs.check()  # a trimmed head op on every draft call
    assert torch.equal(got, plain)
    st = trimpass.stats(draft)
    assert st["mode"] == "dynamic" and max(st["active"]) < V  # trimmed: not every id is active


def test_bad_input_fails_before_anything_is_built():
    model = MODELS["llama"]().eval()
    with pytest.raises(ValueError, match="gamma: tokens drafted per verification"):
        trimpass.self_drafter(model, gamma=0)
    with pytest.raises(ValueError, match=r"confidence: .* in \[0, 1\)"):
        trimpass.self_drafter(model, confidence=1.0)
    with pytest.raises(trimpass.TrimpassError, match="capacity"):
        trimpass.self_drafter(model, capacity=-1)
    with pytest.raises(TypeError, match="model: expected a Hugging Face causal LM"):
        trimpass.self_drafter(torch.nn.Linear(4, 4))
    headless = MODELS["llama"]().eval()
    headless.get_output_embeddings = lambda: None
    with pytest.raises(ValueError, match=r"has no \[V, d\] LM head"):
        trimpass.self_drafter(headless)
    other = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    other.lm_head = torch.nn.Linear(64, V + 5, bias=False)
    with pytest.raises(ValueError, match=f"head has {V + 5} rows but its input embedding {V}"):
        trimpass.self_drafter(other)
    assert "_compiled_call_impl" not in model.__dict__


def test_the_default_drafts_until_the_trimmed_confidence_drops():
    model = MODELS["qwen2"]().eval()
    torch._dynamo.reset()
    draft = trimpass.self_drafter(model, learn_core=64, inner="aot_eager")
    g = draft.generation_config
    assert (g.num_assistant_tokens, g.assistant_confidence_threshold) == (16, 0.4)
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        with head_runs(draft) as runs:
            got = model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=12,
                                 pad_token_id=0)
        assert torch.equal(got, model.generate(ids, do_sample=False, max_new_tokens=12,
                                               pad_token_id=0))
    runs.check()


def test_a_batch_of_two_is_refused_by_hugging_face_with_its_reason():
    model = MODELS["llama"]().eval()
    draft = trimpass.self_drafter(model, inner="aot_eager")
    with torch.no_grad(), pytest.raises(ValueError, match="only supported for batch_size = 1"):
        model.generate(torch.randint(0, V, (2, 5)), assistant_model=draft, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)


def test_the_drafter_keeps_its_cache_across_rounds():
    """Each round the drafter reads only the tokens it has not seen (at most the last round's
    kept drafts and the target's token), never the whole sequence again."""
    from trimpass.hf.selfdraft import shared_copy
    torch.manual_seed(0)
    model = MODELS["gemma3"]().eval()
    draft = shared_copy(model, SelfDraftConfig(4, 0.0))
    seen = []
    base = getattr(draft, draft.base_model_prefix)
    handle = base.register_forward_pre_hook(
        lambda m, args, kw: seen.append((kw.get("input_ids", args[0] if args else None)).shape[1]),
        with_kwargs=True)
    ids = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        out = model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=30,
                             pad_token_id=0)
    handle.remove()
    assert seen[0] == 40 and len(seen) > 8
    assert max(seen[1:]) <= 4 + 1, seen  # gamma drafts + the target's token
    assert torch.equal(out, model.generate(ids, do_sample=False, max_new_tokens=30,
                                           pad_token_id=0))


def test_reset_rows_starts_every_row_of_the_self_drafter_afresh():
    from trimpass.hf.selfdraft import reset_rows
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    draft = trimpass.self_drafter(model, gamma=4, inner="aot_eager", learn_core=8)
    with torch.no_grad():
        model.generate(torch.randint(0, V, (1, 9)), assistant_model=draft, do_sample=False,
                       max_new_tokens=6)
    st = trimpass.active_state(draft)
    assert int(st.count[0]) > st.n_core  # the request's ids joined its row
    reset_rows(draft)
    assert (st.count == st.n_core).all()
