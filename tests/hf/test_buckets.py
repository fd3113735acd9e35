"""Every prompt, first call to last: 20 prompts of distinct lengths from 8 to 1,024 tokens through
each route in one process (the fused loop, and Hugging Face's assisted generation with the model
drafting for itself), past Gemma's sliding window: no exception, no graph compiled after the first
call (warm-up), the trimmed head on every drafter call, and every output identical to plain greedy
decoding or its divergence a near-tie. The HF route's crash past the window is recreated with
Hugging Face's own sliding layers; the cache follows each prompt's bucket; requests that do not fit
the model's positions are refused before any compute."""
import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import trimpass
from tests.graph.test_hf import SMALL, V
from trimpass.diagnostics import divergence
from trimpass.hf import buckets, selfdraft
from trimpass.measure import compiled_graphs
from trimpass.spec.config import SelfDraftConfig
from trimpass.testing.checks import head_runs

FAST = dict(inner="aot_eager")
LENGTHS = sorted({int(x) for x in np.geomspace(8, 1024, 20)})
NEW = 12


def _gemma(context=1200):
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=16,
                                              max_position_embeddings=context,
                                              eos_token_id=None, bos_token_id=None)).eval()


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (1, n), generator=g) for n in LENGTHS]


def _plain(model, ids):
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=NEW, pad_token_id=0)


def _same_or_near_tie(model, ids, got, want):
    d = divergence.explain(model, ids.shape[1], want, got)
    assert d is None or d.near_tie, f"prompt of {ids.shape[1]} tokens: {d}"


def test_lengths_are_distinct_and_span_8_to_1024():
    assert len(LENGTHS) == 20 and LENGTHS[0] == 8 and LENGTHS[-1] == 1024


def test_the_fused_loop_compiles_nothing_after_its_first_call_whatever_the_length():
    torch._dynamo.reset()
    model = _gemma()
    warm = torch.randint(0, V, (1, 5))
    trimpass.generate(model, warm, NEW, gamma=4, learn_core=64, **FAST)
    st = trimpass.stats(model)
    # the body's one-token step, its many-row pass and its tree pass; the rounds' keep, accept
    # (one row, several), the free pass's walk and the prompt's token
    assert st["graphs"] == 8 and st["warm_up_s"] > 0
    loop = model._trimpass_fused
    graphs = compiled_graphs()
    with head_runs(loop.step) as runs:
        outs = [trimpass.generate(model, p, NEW, gamma=4, learn_core=64, **FAST)
                for p in _prompts()]
    assert compiled_graphs() == graphs, "a later prompt compiled a graph"
    runs.check()  # every chunk and every drafting step ran the trimmed head
    for p, got in zip(_prompts(), outs, strict=True):
        _same_or_near_tie(model, p, got, _plain(model, p))


def test_huggingfaces_loop_with_a_self_drafter_compiles_nothing_after_warm_up():
    torch._dynamo.reset()
    model = _gemma()
    draft = trimpass.self_drafter(model, gamma=4, inner="aot_eager")
    assert trimpass.warm_up(model, draft) > 0
    assert trimpass.warm_up(model, draft) == 0.0  # once
    graphs = compiled_graphs()
    with head_runs(draft) as runs:
        outs = [_plain_assisted(model, draft, p) for p in _prompts()]
    assert compiled_graphs() == graphs, "a later prompt compiled a graph"
    runs.check()
    for p, got in zip(_prompts(), outs, strict=True):
        _same_or_near_tie(model, p, got, _plain(model, p))


def _plain_assisted(model, draft, ids):
    with torch.no_grad():
        return model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=NEW,
                              pad_token_id=0)


def test_the_crash_past_the_window_is_hugging_faces_sliding_layer_and_is_gone():
    """Hugging Face's own sliding layer, recording its past for rollback, returns more keys than
    its mask covers once a request passes the window (eager, too); the self-drafter's full-length
    layers do not."""
    model = _gemma()
    ids = torch.randint(0, V, (1, 30))  # past the window of 16 from the first draft
    own = selfdraft.shared_copy(model, SelfDraftConfig(4, 0.0))
    del own._prepare_cache_for_generation  # Hugging Face's cache, sliding layers and all
    with pytest.raises(RuntimeError, match="must match the size"):
        _plain_assisted(model, own, ids)
    fixed = selfdraft.shared_copy(model, SelfDraftConfig(4, 0.0))
    assert torch.equal(_plain_assisted(model, fixed, ids), _plain(model, ids))


def test_the_cache_follows_each_prompts_bucket_without_compiling():
    torch._dynamo.reset()
    model = _gemma(context=4096)
    trimpass.generate(model, torch.randint(0, V, (1, 10)), 4, speculate=False, **FAST)
    loop = model._trimpass_fused
    assert loop.body.capacity == buckets.MIN_CAPACITY
    graphs = compiled_graphs()
    trimpass.generate(model, torch.randint(0, V, (1, 1000)), 4, speculate=False, **FAST)
    assert loop.body.capacity == 1024 and loop.body.cache.layers[0].keys.shape[2] == 1024
    trimpass.generate(model, torch.randint(0, V, (1, 10)), 4, speculate=False, **FAST)
    assert loop.body.capacity == buckets.MIN_CAPACITY and compiled_graphs() == graphs


def test_the_cache_holds_each_request_within_a_granule_up_to_the_context():
    for tokens, want in ((1, 256), (255, 256), (256, 256), (257, 512), (1000, 1024),
                         (3000, 3072), (4000, 4096)):
        assert buckets.capacity_for(tokens, 4096) == want
    assert buckets.capacity_for(4000, 4050) == 4050  # the context caps the last granule


@pytest.mark.parametrize("prompt,new,msg", [
    (301, 1, "input_ids: a prompt of 301 tokens is longer than the model's context of 300"),
    (290, 20, "max_new_tokens: 290 prompt tokens \\+ 20 new ones pass the model.s context of "
              "300 positions .*; ask for at most 10"),
])
def test_a_request_past_the_models_positions_is_refused_before_any_compute(prompt, new, msg):
    model = _gemma(context=300)
    with pytest.raises(ValueError, match=msg):
        trimpass.generate(model, torch.randint(0, V, (1, prompt)), new, **FAST)
    assert not hasattr(model, "_trimpass_fused")
    assert trimpass.generate(model, torch.randint(0, V, (1, 290)), 10, **FAST).shape[1] == 300


def test_warm_up_refuses_settings_beside_a_drafter():
    model = _gemma()
    draft = trimpass.self_drafter(model, inner="aot_eager")
    with pytest.raises(trimpass.TrimpassError, match="warm_up: a self_drafter keeps its own"):
        trimpass.warm_up(model, draft, gamma=3)


def test_a_gpu_cache_comes_in_three_classes_and_refuses_a_request_past_the_largest():
    assert [buckets.capacity_for(n, 131072, "cuda") for n in (1, 2048, 2049, 9000, 32768)] == \
        [2048, 2048, 8192, 32768, 32768]
    assert buckets.capacity_for(3000, 4096, "cuda") == 4096  # the context caps a class
    buckets.check_length(30000, 2768, 131072, "cuda")
    with pytest.raises(ValueError, match="max_new_tokens: 30000 prompt tokens \\+ 2769 new ones "
                                         "pass the loop's largest cache of 32768 positions"):
        buckets.check_length(30000, 2769, 131072, "cuda")
    with pytest.raises(ValueError, match="input_ids: a prompt of 40000 tokens is longer than "
                                         "the loop's largest cache"):
        buckets.check_length(40000, 1, 131072, "cuda")
    buckets.check_length(40000, 1, 131072, "cpu")  # the CPU's cache follows the request


def test_a_mode_inductor_does_not_know_is_refused_before_any_compile():
    model = _gemma()
    with pytest.raises(trimpass.TrimpassError, match="mode: one inductor knows .*reduce-overhead"
                                                     ".* got 'fast'"):
        trimpass.generate(model, torch.randint(0, V, (1, 5)), 4, mode="fast")
    assert not hasattr(model, "_trimpass_fused")


def test_a_padded_prompt_pass_as_on_a_gpu_changes_no_token_and_compiles_nothing_new(
        monkeypatch):
    assert buckets.padded_rows(70, "cuda") == 128 and buckets.padded_rows(70, "cpu") == 70
    torch._dynamo.reset()
    model = _gemma()
    prompts = [torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (5, 70, 130)]
    want = [trimpass.generate(model, p, NEW, gamma=4, learn_core=64, **FAST) for p in prompts]
    monkeypatch.setattr(buckets, "PADDED", ("cuda", "cpu"))  # the GPU's padding, on the CPU
    torch._dynamo.reset()
    padded = _gemma()
    got = [trimpass.generate(padded, prompts[0], NEW, gamma=4, learn_core=64, **FAST)]
    assert padded._trimpass_fused.body.slack >= buckets.PREFILL_ROWS - 1
    graphs = compiled_graphs()
    got += [trimpass.generate(padded, p, NEW, gamma=4, learn_core=64, **FAST)
            for p in prompts[1:]]
    assert compiled_graphs() == graphs, "a padded prompt of a new length compiled a graph"
    for p, g, w in zip(prompts, got, want, strict=True):
        _same_or_near_tie(model, p, g, w)


def test_a_gpu_keeps_every_class_allocated_and_a_cpu_only_the_last():
    assert buckets.kept_classes("cuda") == len(buckets.CUDA_CLASSES)
    assert buckets.kept_classes("cpu") == 1
    torch._dynamo.reset()
    model = _gemma(context=4096)
    for n in (10, 1000, 10):
        trimpass.generate(model, torch.randint(0, V, (1, n)), 4, speculate=False, **FAST)
    assert list(model._trimpass_fused.body.caches) == [buckets.MIN_CAPACITY]
