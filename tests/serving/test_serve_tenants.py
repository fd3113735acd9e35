"""Tenants through vLLM's OpenAI server (tiny random Gemma3 as its own trimmed drafter, fp32, D-Cut
with lookup and the suffix index, in check mode): each request names its tenant in ``vllm_xargs``.
Tenant a's requests run, then tenant b's (a's prompts, cut to a few tokens), then a's again; the
worker records every id the suffix index offered each tenant. No id of a's outputs that b's own
texts do not hold is ever offered to b (where b read a's outputs, the ids a wrote past b's cut
would be); a's repeated requests draft from its earlier outputs (the index's drafts verified and
kept); every greedy output equals the one vLLM gives without speculation; a tenant that is not a
string is a 400 naming the argument. A server serving one tenant refuses a request naming another
(the front end's check, called as vLLM calls it)."""
import os
import sys

import pytest

pytest.importorskip("vllm")

from trimpass.testing import serve_load as sl  # noqa: E402

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
import vllm_run  # noqa: E402
from test_serve_load import ARGS, KEEP, _env  # noqa: E402

N = 6


def _requests(lo: int, tenant, seed: int) -> list:
    reqs = sl.plan(N, lo + 400, 128, seed=seed, lo=lo, prompt_len=(6, 20), max_tokens=(30, 40),
                   sampled=0.0, stream=0.0, bad_every=0)
    for r in reqs:
        r.xargs = {"trimpass_tenant": tenant}
    return reqs


def _serve(model, tmp, name, spec, batches):
    from trimpass.serving import vllm as tv
    with sl.Server(model, ARGS + (tv.cli_args(spec) if spec else []),
                   str(tmp / f"{name}.log"), _env(tmp)) as s:
        results = [sl.drive(s.url, "tiny", reqs, 4, 300)[0] for reqs in batches]
        stats = sl.worker_stats(str(tmp / name), until_rows_zero=20) if spec else []
    return results, stats


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    model = str(tmp / "gemma3")
    vllm_run.make_model(model)
    from trimpass.serving import vllm as tv
    a = _requests(600, "a", 1)
    b = [sl.Req(r.i + 50, r.prompt, 8, xargs={"trimpass_tenant": "b"}) for r in a]
    bad = _requests(1800, 5, 3)[:1]
    batches = [a, b, [sl.Req(r.i + 100, r.prompt, r.max_tokens, xargs=r.xargs) for r in a], bad]
    spec = tv.engine_args(model, None, vllm_run.K, check=True, learn_core=0, keep=KEEP,
                          capacity=1024, stats_dir=str(tmp / "trim"),
                          budget={"policy": "dcut", "measure_s": 2})
    trimmed = _serve(model, tmp, "trim", spec, batches)
    plain = _serve(model, tmp, "none", None, batches[:3])
    return batches, trimmed, plain


def _texts(results) -> set:
    return {t for r in results for t in [*r.req.prompt, *r.tokens]}


def test_no_id_of_one_tenant_is_offered_to_another(served):
    _, (results, stats), _ = served
    assert stats, "the worker wrote no stats file"
    offered = stats[0]["suffix"]["offered"]
    a_texts, b_texts = _texts(results[0] + results[2]), _texts(results[1])
    assert set(offered) <= {"a", "b"} and offered.get("b") is not None
    assert not (set(offered["b"]) - b_texts) & a_texts
    assert set(offered["a"]) & a_texts  # the canary's tenant itself was offered its ids


def test_repeated_requests_draft_from_their_tenants_earlier_outputs(served):
    _, (_, stats), _ = served
    s = stats[0]
    # a's first requests and b's were kept before a's repeats ran (the last finish is kept at
    # the next engine step)
    assert s["suffix"]["outputs"] >= N and s["suffix"]["tenants"] == 2, s["suffix"]
    assert s["suffix_accepted"] > 0, s


def test_greedy_outputs_equal_vllms_without_speculation(served):
    batches, (results, _), (plain, _) = served
    for got, want in zip(results[:3], plain, strict=True):
        assert [r.status for r in got] == [200] * len(got)
        assert [r.tokens for r in got] == [r.tokens for r in want]


def test_a_tenant_that_is_not_a_string_is_a_400_naming_it(served):
    _, (results, _), _ = served
    (bad,) = results[3]
    assert bad.status == 400 and "vllm_xargs trimpass_tenant: a string" in bad.error, bad.error


def test_a_server_serving_one_tenant_refuses_a_request_naming_another():
    from vllm.exceptions import VLLMValidationError

    from trimpass.serving import vllm_compat as compat
    from trimpass.serving.vllm_state import Hooks

    class Processor:  # vLLM's InputProcessor as the wrapper reads it
        def __init__(self, budget):
            self.vllm_config = type("C", (), {"additional_config": {"trimpass": {
                "budget": budget}}})()

    class Params:
        def __init__(self, tenant):
            self.extra_args = {"trimpass_tenant": tenant}

    check = compat._validate(Hooks(startup=None), lambda self, params: "checked")
    one = Processor({"policy": "dcut", "tenant": "acme"})
    assert check(one, Params("acme")) == "checked"
    with pytest.raises(VLLMValidationError, match="vllm_xargs trimpass_tenant: this server "
                                                  "serves tenant 'acme' alone .* another "
                                                  "tenant's \\('globex'\\)"):
        check(one, Params("globex"))
    shared = Processor({"policy": "dcut", "tenant": "acme", "suffix": {"share": True}})
    assert check(shared, Params("globex")) == "checked"
    assert check(Processor({"policy": "dcut"}), Params("globex")) == "checked"
