"""gpu_check's section for the fused loop (``trimpass.generate``): a random-weight Llama-shaped
model decoded greedily by the fused loop and plainly through the same compiled body on the same
static cache, graph against graph (every graph captured through inductor's ``reduce-overhead`` on a
GPU; aot_eager at tiny sizes on the dry run). Checks that the outputs are identical, that the
trimmed head drafted, and that a round read the host once (plus its near-tie rechecks); reports
tokens/s of both and the host's CPU microseconds per round (sync waits included; random weights:
acceptance means nothing, so no speed check). Skipped where transformers is not installed."""
from __future__ import annotations

import time

import torch


def section(c, device: str, dtype) -> list[dict]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        c.skip("fused: the loop's output equals plain decoding", "transformers is not installed")
        return []
    import trimpass
    gpu = device == "cuda"
    V, d, layers, new = (128_256, 512, 4, 64) if gpu else (1_031, 64, 2, 12)
    settings = dict(inner="inductor", mode="reduce-overhead") if gpu else dict(inner="aot_eager")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=4 * d,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, V, (1, 32), device=device)
    out, secs, cpu, reads = {}, {}, {}, {}
    for label, kw in (("plain", dict(speculate=False)), ("fused", dict(gamma=4, confidence=0.0))):
        trimpass.generate(model, ids, new, **kw, **settings)  # compiles (and captures) first
        trimpass.generate(model, ids.flip(1), new, **kw, **settings)  # the replays' second call
        loop, rounds = model._trimpass_fused, trimpass.stats(model)["rounds"]
        was, rechecks = loop.reads, trimpass.stats(model)["rechecks"]
        if gpu:
            torch.cuda.synchronize()
        t, c0 = time.perf_counter(), time.thread_time()
        out[label] = trimpass.generate(model, ids, new, **kw, **settings)
        if gpu:
            torch.cuda.synchronize()
        secs[label], cpu[label] = time.perf_counter() - t, time.thread_time() - c0
        st = trimpass.stats(model)
        n = max(st["rounds"] - rounds, 1) if label == "fused" else new
        reads[label] = (loop.reads - was, n, st["rechecks"] - rechecks)
        cpu[label] = cpu[label] / n * 1e6
    st = trimpass.stats(model)
    c.check("fused: the loop's output equals plain decoding through the same body",
            torch.equal(out["fused"], out["plain"]), f"{out['fused'].shape[1] - 32} new tokens")
    c.check("fused: the trimmed head drafted every body step",
            st["trimmed_calls"] == st["body_steps"] > 0,
            f"{st['trimmed_calls']} trimmed calls, {st['verifications']} verifications")
    got, rounds, rechecks = reads["fused"]
    c.check("fused: one host read a round, plus near-tie rechecks",
            got <= rounds + rechecks + 1, f"{got} reads, {rounds} rounds, {rechecks} rechecks")
    r = dict(section="fused", V=V, d=d, layers=layers, plain_tps=new / secs["plain"],
             fused_tps=new / secs["fused"], acceptance=st["acceptance"], mat=st["mat"],
             host_us_per_round=cpu["fused"], host_us_per_plain_token=cpu["plain"],
             reads_per_round=(got - 1) / rounds)
    print(f"\n## fused loop (random-weight Llama shape V={V:,}, d={d}, {layers} layers, {dtype})")
    print("| plain tokens/s | fused tokens/s | acceptance | MAT | host us/round | "
          "host us/plain token | reads/round |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['plain_tps']:.1f} | {r['fused_tps']:.1f} | {r['acceptance']:.2f} | "
          f"{r['mat']:.2f} | {r['host_us_per_round']:.0f} | {r['host_us_per_plain_token']:.0f} | "
          f"{r['reads_per_round']:.2f} |")
    print("random weights: acceptance and speed are not the real model's; host us: this "
          "thread's CPU time, sync waits included\n")
    return [r]
