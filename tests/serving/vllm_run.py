"""Run a tiny model through a real vLLM engine and print one JSON line of results (tests only).

Run as a script by tests/serving/test_vllm.py in a subprocess (vLLM spawns processes, so its
engines want a ``__main__`` guard, and each engine gets a fresh process):
``python vllm_run.py MODEL_DIR MODE SETTINGS_JSON``, MODE one of ``none`` (no speculation),
``plain`` (the model as its own drafter, untrimmed), ``trim`` and ``trim-tp2`` (trimmed, the
engine sharded over 2 tensor-parallel workers; on a one-NUMA-node CPU vLLM wants
``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``), ``dcut`` (trimmed, with SETTINGS_JSON as the D-Cut
budget; see :func:`dcut_run`), ``skip`` (trimmed, speculation paused on a schedule of engine
steps; see :func:`skip_run`), ``sample`` (temperature 1). Greedy, fp32; every prompt is
generated alone (concurrency 1), then all of them at once (concurrency ``len(prompts)``).
"""
from __future__ import annotations

import json
import os
import sys

V, K = 2048, 3


def run_script(script: str, *args: str, in_process: bool = False, **extra_env) -> dict:
    """Run ``script`` (this directory's, e.g. ``vllm_run.py``) with ``args`` in a fresh process,
    trimpass enabled and Triton's interpreter off, and return its ``RESULT`` JSON line (tests).
    ``args[0]`` is the test's model directory (in pytest's temporary folder): trimpass's cache
    (the budget's measurements) goes beside it, never into the user's. ``in_process``: vLLM's
    engine core and worker run in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the same
    engine without its process boundaries, which saves two interpreters' start-up, about 20 s an
    engine here); by default they run in their own processes, as a user's do."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                             "TRIMPASS_DISABLE", "TRIMPASS_VLLM",
                                                             "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["TRIMPASS_CACHE"] = os.path.join(os.path.dirname(os.path.abspath(args[0])), "cache")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra_env)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, os.path.join(here, script), *args], capture_output=True,
                       text=True, env=env, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def make_model(d: str, vocab: int = V) -> None:
    """A tiny random Gemma3ForCausalLM (untied head, so greedy outputs vary) in safetensors."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, max_position_embeddings=512, sliding_window=64,
                           layer_types=["full_attention"] * 2, tie_word_embeddings=False,
                           initializer_range=0.2)
    m = Gemma3ForCausalLM(cfg).eval()
    m.config.architectures = ["Gemma3ForCausalLM"]
    m.save_pretrained(d)


def prompts() -> list[list[int]]:
    """Six prompts; the first two draw from disjoint rare ranges (ids >= 1800)."""
    import torch
    g = torch.Generator().manual_seed(7)
    out = [[1800 + i for i in range(0, 24, 2)], [1900 + i for i in range(0, 24, 2)]]
    out += [torch.randint(0, V, (10 + 3 * i,), generator=g).tolist() for i in range(4)]
    return out


ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              gpu_memory_utilization=0.2, enforce_eager=True, max_num_seqs=8,
              disable_log_stats=False)  # every greedy engine of these tests


SAMPLE_V, SAMPLE_PROMPT, SAMPLES = 64, [1, 2, 3, 4, 5], 3000


def sample(d: str, settings: dict) -> None:
    """Temperature 1, probabilistic drafts (vLLM's rejection sampler uses their probabilities):
    SAMPLES seeded requests of one prompt; prints the (first, second) token pairs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    trim = not settings.pop("untrimmed", False)
    args = tv.engine_args(d, None, K, trim=trim, **settings)
    args["speculative_config"]["draft_sample_method"] = "probabilistic"
    llm = LLM(**args, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
              gpu_memory_utilization=0.2, enforce_eager=True, max_num_seqs=64)
    ps = [SamplingParams(temperature=1.0, max_tokens=2, detokenize=False, ignore_eos=True,
                         seed=i) for i in range(SAMPLES)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=SAMPLE_PROMPT)] * SAMPLES, ps,
                        use_tqdm=False)
    pairs = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"pairs": pairs, "stats": {
        k: v for k, v in tv.stats(llm).items() if k != "seen"}}), flush=True)


def dcut_run(d: str, settings: dict, kw: dict) -> None:
    """D-Cut (``settings``: the budget) on the trimmed drafter, then the fixed policy switched on
    in the same engine; greedy outputs of all prompts at once, each run's budget counters and
    vLLM's own count of drafted tokens it verified."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    llm = LLM(**tv.engine_args(d, None, K, budget=settings, check=True), **kw)
    sp = SamplingParams(temperature=0, max_tokens=24, detokenize=False, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    res = {}
    for name, policy in (("dcut", None), ("fixed", {"policy": "fixed", "gamma": 1})):
        if policy:
            tv.set_budget(llm, policy)
        before = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        out = [list(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]
        after = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        key = "vllm:spec_decode_num_draft_tokens"
        st = tv.stats(llm)
        res[name] = {"together": out, "verified_drafts": after.get(key, 0) - before.get(key, 0),
                     "budget": st["budget"], "calls": st["calls"], "fallbacks": st["fallbacks"]}
    print("RESULT " + json.dumps(res), flush=True)


def skip_run(d: str, settings: dict, kw: dict) -> None:
    """All prompts at once, stepped by hand: a fixed draft length of K, paused (policy ``none``)
    at every engine step ``i`` with ``i % 4`` in ``settings["pause"]`` (two consecutive pauses by
    default; ``[]`` pauses nothing). ``settings["stale"]`` makes the drafter skip its forwards
    without the target's cache (a negative control: the engine core runs in this process, where
    :meth:`trimpass.serving.vllm_state.Proposer.share_cache` is replaced by one that shares
    nothing). Greedy outputs, the budget counters and each proposal's first drafted row (check
    mode)."""
    import collections
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one engine step per step() call
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    from trimpass.serving import vllm_kv, vllm_state
    pause = set(settings.get("pause", [1, 2]))
    if settings.get("stale"):
        def share_nothing(state, pairs):
            state.cache_shared = True
            return {}
        vllm_state.Proposer.share_cache = share_nothing
    if settings.get("own_cache"):  # the drafter keeps its own cache, as vLLM's route does
        vllm_kv.same_model = lambda drafter, target: False
    sampling = count_sampling()
    fixed = {"policy": "fixed", "gamma": K}
    llm = LLM(**tv.engine_args(d, None, K, budget=fixed, check=True, learn_core=0,
                               keep=list(range(512)), capacity=1024),
              **kw, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=24, detokenize=False, ignore_eos=True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    out, step, paused, counts = {}, 0, False, collections.Counter()

    def add_counts():  # set_budget starts the budget's counters from zero
        counts.update({k: v for k, v in tv.stats(llm)["budget"].items()
                       if isinstance(v, int) and not isinstance(v, bool)
                       and k not in ("gamma", "verified_max")})

    while engine.has_unfinished_requests():
        if (step % 4 in pause) != paused:
            add_counts()
            paused = not paused
            tv.set_budget(llm, "none" if paused else fixed)
        for o in engine.step():
            if o.finished:
                out[int(o.request_id)] = list(o.outputs[0].token_ids)
        step += 1
    add_counts()
    st = tv.stats(llm)
    print("RESULT " + json.dumps({"together": [out[i] for i in range(len(out))],
                                  "budget": {**st["budget"], **counts},
                                  "first": st.get("first", {}),
                                  "shared_cache": st.get("shared_cache", {}),
                                  "calls": st["calls"], "violations": st["violations"],
                                  "steps": st["steps"], "plain_steps": st["plain_steps"],
                                  "sampling": dict(sampling)}), flush=True)


def count_sampling():
    """Counts, in this process's engine, the engine steps with and without drafted tokens to
    verify (``steps_drafts``, ``steps_no_drafts``) and the rejection sampler's calls in each
    (``rejection_drafts``, ``rejection_no_drafts``)."""
    import collections

    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    counts, now = collections.Counter(), {"kind": None}
    execute, reject = GPUModelRunner.execute_model, RejectionSampler.forward

    def counted_execute(self, scheduler_output, *args, **kwargs):
        drafts = sum(len(v) for v in scheduler_output.scheduled_spec_decode_tokens.values())
        now["kind"] = "drafts" if drafts else "no_drafts"
        counts[f"steps_{now['kind']}"] += 1
        return execute(self, scheduler_output, *args, **kwargs)

    def counted_reject(self, *args, **kwargs):
        if now["kind"] is not None:  # not the start-up's dummy sampler run
            counts[f"rejection_{now['kind']}"] += 1
        return reject(self, *args, **kwargs)

    GPUModelRunner.execute_model, RejectionSampler.forward = counted_execute, counted_reject
    return counts


def main() -> None:
    d, mode, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if not os.path.exists(os.path.join(d, "config.json")):
        make_model(d, SAMPLE_V if mode == "sample" else V)
    if mode == "sample":
        return sample(d, settings)
    from vllm import LLM

    from trimpass.serving import vllm as tv
    kw = dict(ENGINE)
    if mode.endswith("-tp2"):
        mode = mode.removesuffix("-tp2")
        kw.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    if mode == "none":
        args = {"model": d}
    elif mode == "dcut":
        return dcut_run(d, settings, kw)
    elif mode == "skip":
        return skip_run(d, settings, kw)
    else:
        args = tv.engine_args(d, None, K, trim=mode == "trim",
                              **(settings if mode == "trim" else {}))
    print("RESULT " + json.dumps(greedy_results(LLM(**args, **kw), mode != "none")), flush=True)


def greedy_results(llm, speculative: bool) -> dict:
    """Every prompt greedy, alone then all at once; vLLM's drafted and accepted counts and, with
    speculation, trimpass's worker counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trimpass.serving import vllm as tv
    sp = SamplingParams(temperature=0, max_tokens=24, detokenize=False, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    solo = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in ps]
    together = [list(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)]
    res = {"solo": solo, "together": together, "prompts": prompts()}
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    res["accepted"] = metrics.get("vllm:spec_decode_num_accepted_tokens")
    res["drafted"] = metrics.get("vllm:spec_decode_num_draft_tokens")
    if speculative:
        st = tv.stats(llm)
        st["seen"] = {k: sorted(v) for k, v in st.get("seen", {}).items()}
        res["stats"] = st
    return res


if __name__ == "__main__":
    main()
