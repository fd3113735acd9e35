"""gpu_check's section for the fused loop (``trimpass.generate``): a random-weight Llama-shaped
model decoded greedily by the fused loop and plainly through the same compiled body, on the device
(CUDA graphs through inductor's ``reduce-overhead`` on a GPU; aot_eager at tiny sizes on the dry
run). Checks that the outputs are identical and that the trimmed head drafted; reports tokens/s of
both (random weights: acceptance means nothing, so no speed check). Skipped where transformers is
not installed."""
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
    out, secs = {}, {}
    for label, kw in (("plain", dict(speculate=False)), ("fused", dict(gamma=4, confidence=0.0))):
        trimpass.generate(model, ids, new, **kw, **settings)  # compiles (and captures) first
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out[label] = trimpass.generate(model, ids, new, **kw, **settings)
        if gpu:
            torch.cuda.synchronize()
        secs[label] = time.perf_counter() - t
    st = trimpass.stats(model)
    c.check("fused: the loop's output equals plain decoding through the same body",
            torch.equal(out["fused"], out["plain"]), f"{out['fused'].shape[1] - 32} new tokens")
    c.check("fused: the trimmed head drafted every body step",
            st["trimmed_calls"] == st["body_steps"] > 0,
            f"{st['trimmed_calls']} trimmed calls, {st['verifications']} verifications")
    r = dict(section="fused", V=V, d=d, layers=layers, plain_tps=new / secs["plain"],
             fused_tps=new / secs["fused"], acceptance=st["acceptance"], mat=st["mat"])
    print(f"\n## fused loop (random-weight Llama shape V={V:,}, d={d}, {layers} layers, {dtype})")
    print("| plain tokens/s | fused tokens/s | acceptance | MAT |")
    print("|---|---|---|---|")
    print(f"| {r['plain_tps']:.1f} | {r['fused_tps']:.1f} | {r['acceptance']:.2f} | "
          f"{r['mat']:.2f} |")
    print("random weights: acceptance and speed are not the real model's\n")
    return [r]
