"""divergence.explain: agreeing outputs have no divergence; a route's token that ties plain
decoding's top logit is a near-tie; a token far below it is not (a bug, reported as such); the gap
is counted in ulps of the dtype at the top logit."""
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.graph.test_hf import SMALL, V
from trimpass.diagnostics import divergence, replay


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()


def _greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, do_sample=False, max_new_tokens=n, pad_token_id=0)


def test_agreeing_outputs_have_no_divergence():
    model = _model()
    ids = torch.randint(0, V, (1, 9))
    out = _greedy(model, ids, 6)
    assert divergence.explain(model, 9, out, out.clone()) is None
    assert divergence.first_difference(out, out[:, :12], 9) is None  # shorter, not different


def test_a_token_far_below_the_top_is_not_a_near_tie():
    model = _model()
    ids = torch.randint(0, V, (1, 9))
    plain = _greedy(model, ids, 6)
    with torch.no_grad():
        z = model(plain[:, :11]).logits[0, -1]
    worst = int(z.argmin())
    route = plain.clone()
    route[0, 11] = worst
    d = divergence.explain(model, 9, plain, route)
    assert (d.position, d.plain, d.route) == (2, int(plain[0, 11]), worst)
    assert d.gap > 0.1 and d.spread < 1e-3 and not d.near_tie


def test_a_tie_in_the_head_is_a_near_tie():
    model = _model()
    ids = torch.randint(0, V, (1, 9))
    plain = _greedy(model, ids, 4)
    a = int(plain[0, 10])
    b = (a + 1) % V
    with torch.no_grad():  # row b becomes row a: the two logits are equal everywhere
        model.lm_head.weight[b] = model.lm_head.weight[a]
    plain = _greedy(model, ids, 4)
    route = plain.clone()
    route[0, 10] = b if int(plain[0, 10]) == a else a
    d = divergence.explain(model, 9, plain, route)
    assert d.position == 1 and d.gap == 0.0 and d.near_tie


def test_ulps_of_the_top_logit():
    assert divergence.ulp(1.0, torch.bfloat16) == 2 ** -7
    assert divergence.ulp(-3.0, torch.bfloat16) == 2 ** -6
    assert divergence.ulp(20.0, torch.float32) == 2 ** -19


def test_a_tally_is_lossless_with_near_ties_and_not_with_a_far_token():
    model = _model()
    ids = torch.randint(0, V, (1, 9))
    plain = _greedy(model, ids, 4)
    far = plain.clone()
    with torch.no_grad():
        far[0, 10] = int(model(plain[:, :10]).logits[0, -1].argmin())
    t = divergence.Tally()
    t.add(model, 9, plain, plain.clone())
    assert (t.same, t.total, t.lossless, t.mark(), t.cell()) == (1, 1, True, "✓", "0 / 0 (-)")
    a = int(plain[0, 11])
    with torch.no_grad():  # a tie at new token 2: the route may emit either token there
        model.lm_head.weight[(a + 1) % V] = model.lm_head.weight[a]
    tied = _greedy(model, ids, 4)
    assert torch.equal(tied[:, :12], plain[:, :12])
    route = tied.clone()
    route[0, 11] = (a + 1) % V
    t.add(model, 9, tied, route)
    assert t.lossless and t.mark() == "✓ (1 near-tie)" and t.ties[0][0] == 1
    assert t.cell() == "1 / 0 (0.0)"
    t.add(model, 9, tied, far)
    assert not t.lossless and t.mark() == "✗" and t.bugs[0][0] == 2 and t.total == 3
    assert re.fullmatch(r"1 / 1 \(0\.0, \d+\.\d\)", t.cell()), t.cell()
    assert "1 of 3 identical; near-ties 1 (prompt 2 at new token 2: gap 0.0 ulps" in str(t)


def _fused_reference(prompt: int, n: int):
    """A model, a random prompt, the fused loop's plain decoding of it and that loop."""
    import trimpass
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, V, (1, prompt))
    out = trimpass.generate(model, ids, n, speculate=False, inner="aot_eager")
    return model, ids, out, model._trimpass_fused


def test_the_fused_loops_own_logits_are_the_models_both_ways():
    model, ids, out, loop = _fused_reference(11, 6)
    with torch.no_grad():
        want = model(out[:, :15]).logits[0, -1]
    steps, batched = replay.logits(loop, out[:, :15], 11), replay.logits(loop, out[:, :15], 15)
    assert steps.shape == batched.shape == (V,)
    torch.testing.assert_close(steps, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched, want, rtol=1e-4, atol=1e-4)
    assert int(steps.argmax()) == int(out[0, 15])  # plain decoding's own next token
    # a route given its own ways: a token far below the top is still a bug
    far = out.clone()
    far[0, 15] = int(want.argmin())
    d = divergence.explain(model, 11, out, far, lambda p, k: replay.logits(loop, p, k),
                           lambda p, _: replay.logits(loop, p, p.shape[1]))
    assert d.position == 4 and not d.near_tie and d.spread < 1e-3


def _divergence(ulps, near_tie):
    return divergence.Divergence(position=0, plain=1, route=2, gap=ulps, spread=1.0, ulps=ulps,
                                 spread_ulps=1.0, near_tie=near_tie)


def test_a_chain_of_stages_is_its_worse_stage_and_a_bug_anywhere_is_a_bug():
    small, large, bug = _divergence(1.5, True), _divergence(3.0, True), _divergence(0.5, False)
    assert divergence.worst([None, None]) is None
    assert divergence.worst([small, None, large]) is large
    assert divergence.worst([large, bug]) is bug and divergence.worst([bug, small]) is bug
    t = divergence.Tally()
    for d in (None, small, bug, None):
        t.record(d)
    assert (t.same, t.ties, t.bugs, t.lossless) == (2, [(1, small)], [(2, bug)], False)


def test_a_fused_output_is_explained_through_the_loops_body_in_two_stages():
    model, ids, ref, loop = _fused_reference(13, 5)
    plain = _greedy(model, ids, 5)
    far = ref.clone()
    with torch.no_grad():
        far[0, 15] = int(model(ref[:, :15]).logits[0, -1].argmin())
    own, eager = divergence.fused_stages(model, loop, 13, plain, ref, far)
    assert own.position == 2 and not own.near_tie  # the route left its reference: a bug
    assert eager == divergence.explain(model, 13, plain, ref,
                                       route_way=lambda p, k: replay.logits(loop, p, k))
    assert divergence.fused_stages(model, loop, 13, plain, ref, ref.clone())[0] is None


def test_a_fused_call_replays_bit_for_bit_and_a_token_its_logits_do_not_rank_first_is_a_bug():
    """The route's own computation, replayed from its call's trace (prefill, one-token steps,
    free drafts' tree passes with the paths they kept, and rollbacks), gives back every token the
    route emitted; with it, a token below the top of the route's own logits is a bug, whatever
    the gap."""
    import trimpass
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, V, (1, 12)).repeat(1, 3)  # text that repeats itself: lookup drafts
    trimpass.generate(model, ids, 24, inner="aot_eager")  # builds the loop
    loop, P = model._trimpass_fused, ids.shape[1]
    tracer = replay.Tracer.attach(loop)  # the hook: the loop imports nothing of it
    out = trimpass.generate(model, ids, 24, inner="aot_eager")
    trace = list(tracer.trace)
    st = trimpass.stats(model)["sources"]
    assert st["lookup"]["rounds"] > 0 and st["self"]["rounds"] > 0, st  # both kinds replayed
    assert {e[0] for e in trace} == {"cache", "rollback", "pass", "tree"}  # free drafts: trees
    for i in range(P, out.shape[1]):
        z = replay.replayed(loop, trace, i - 1)
        assert int(z.argmax()) == int(out[0, i]), i
    assert tracer.trace == trace  # a replay records nothing
    ref = trimpass.generate(model, ids, 24, speculate=False, inner="aot_eager")
    body = model._trimpass_fused
    assert torch.equal(ref, out)  # fp32, tiny: the route is its reference
    wrong = out.clone()
    z = replay.replayed(loop, trace, P + 2)
    wrong[0, P + 3] = int(z.argsort()[-2])  # the route's own runner-up
    own, _ = divergence.fused_stages(model, body, P, out, ref, wrong, (loop, trace))
    assert own.position == 3 and not own.near_tie
    assert divergence.fused_stages(model, body, P, out, ref, out, (loop, trace))[0] is None
    with pytest.raises(ValueError, match="position"):
        replay.replayed(loop, trace, out.shape[1] + 5)
