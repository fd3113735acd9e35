"""trimpass.hf.assisted: HF assisted generation measured from the outside, at a tiny size (random
weights, no download): the loop's statistics add up, the output is the target's own (lossless), the
trimmed head ran on every drafter call, and the drafter is left as it was found."""
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trimpass
from trimpass.hf import assisted
from trimpass.testing.checks import head_runs

CFG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
           pad_token_id=0)


def test_assisted_run_is_lossless_trimmed_and_counts_add_up():
    torch._dynamo.reset()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**CFG)).double().eval()
    prompts = [torch.randint(1, 512, (10,)).tolist() for _ in range(2)]
    plain, refs = assisted.run(target, None, prompts, 12, "target alone")
    assert plain.emitted == 24 and plain.draft_calls == 0 and plain.rounds == 24
    assert plain.mat == 1.0 and plain.tokens_per_s > 0

    draft = trimpass.trim(copy.deepcopy(target), vocab=torch.arange(0, 512, 2), inner="aot_eager")
    compiled = draft._compiled_call_impl
    track = []
    with head_runs(draft) as runs:
        st, outs = assisted.run(target, draft, prompts, 12, "trimmed", refs,
                                on_draft_call=lambda: track.append(1))
    assert st.lossless and all(torch.equal(a, b) for a, b in zip(outs, refs, strict=True))
    runs.check()
    assert runs.calls == st.draft_calls == len(track) == st.drafted > 0
    assert st.emitted == 24 and 0 < st.rounds <= 24
    assert st.accepted == st.emitted - st.rounds and 0 <= st.acceptance <= 1
    assert st.draft_ms > 0 and st.draft_s > 0
    assert draft._compiled_call_impl is compiled  # the timing wrapper is gone
