"""divergence.explain: agreeing outputs have no divergence; a route's token that ties plain
decoding's top logit is a near-tie; a token far below it is not (a bug, reported as such); the gap
is counted in ulps of the dtype at the top logit."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.graph.test_hf import SMALL, V
from trimpass.hf import divergence


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
