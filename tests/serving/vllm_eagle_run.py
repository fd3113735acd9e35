"""Run a tiny Llama target through a real vLLM engine with a tiny random EAGLE drafter and print
one JSON line of results (tests only; run by tests/serving/test_vllm_eagle.py in a subprocess):
``python vllm_eagle_run.py DIR MODE SETTINGS_JSON``, MODE one of ``none`` (no speculation),
``eagle`` and ``eagle3`` (trimmed with SETTINGS_JSON), ``gemma-none`` and ``gemma-eagle`` (a tiny
Gemma3 target alone, and with a drafter trimpass's trainer wrote). The EAGLE-3 drafter has its
own 1,024-id head vocabulary (a ``d2t`` map) inside the target's 2,048 ids. Greedy, fp32; prompts
and the run as in ``vllm_run.py``.
"""
from __future__ import annotations

import json
import os
import sys

import vllm_run as vr  # this script's directory is on sys.path

HIDDEN, HEADS, HEAD_DIM, FFN = 64, 2, 32, 128
DRAFT_V = 1024


def make_target(d: str) -> None:
    """A tiny random one-layer LlamaForCausalLM (vLLM's Llama serves both EAGLE routes): untied
    head, embeddings of RMS 1 (so its input norm is the identity) and its attention scaled down,
    so that the next token depends mostly on the current one and an EAGLE drafter built from its
    weights (:func:`make_drafter`) is accepted often but not always."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vr.V, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=1,
                      head_dim=HEAD_DIM, max_position_embeddings=512, tie_word_embeddings=False,
                      initializer_range=0.2, rms_norm_eps=1e-6)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        e /= e.pow(2).mean(-1, keepdim=True).sqrt()
        m.model.layers[0].self_attn.o_proj.weight *= 0.3
    m.config.architectures = ["LlamaForCausalLM"]
    m.save_pretrained(d)


def draft_targets() -> list[int]:
    """The EAGLE-3 head's vocabulary: half the target's ids, every fourth of the rare prompts'
    ranges (1800.. and 1900..) among them, so rows hold ids the head cannot score."""
    import torch
    g = torch.Generator().manual_seed(3)
    rare = set(range(1800, 1824)) | set(range(1900, 1924))
    rest = [i for i in range(vr.V) if i not in rare]
    inside = {i for i in rare if i % 4 == 0}
    keep = {rest[int(i)] for i in torch.randperm(len(rest), generator=g)[:DRAFT_V - len(inside)]}
    return sorted(keep | inside)


def make_drafter(d: str, method: str, target: str) -> None:
    """A one-layer EAGLE drafter from the target's weights, in safetensors. ``eagle``: fc picks
    the next token's embedding out of [embedding, hidden state], then the target's own layer (its
    input norm is the identity on RMS-1 embeddings, as the EAGLE layer's), the target's head
    shared. ``eagle3``: fc is zero, attention copies the current token's embedding (large q.k on
    itself), then the target's MLP, final norm and head rows over :func:`draft_targets` (the
    ``d2t`` map): the target without its attention, on half its vocabulary."""
    import torch
    from safetensors.torch import load_file, save_file
    t = load_file(os.path.join(target, "model.safetensors"))
    os.makedirs(d, exist_ok=True)
    eye = torch.eye(HIDDEN)
    zero = torch.zeros(HIDDEN, HIDDEN)
    own = ("mlp.", "post_attention_layernorm.") + (("self_attn.",) if method == "eagle" else ())
    layer = {k[len("model.layers.0."):]: v for k, v in t.items()
             if k.startswith(tuple("model.layers.0." + o for o in own))}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vr.V,
           "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": 1,
           "num_attention_heads": HEADS, "num_key_value_heads": 1, "head_dim": HEAD_DIM,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
           "tie_word_embeddings": False}
    if method == "eagle":
        tensors = {"fc.weight": torch.cat([eye, zero], 1)}
        prefix = "layers.0."
    else:
        pick = torch.cat([eye, zero], 1)  # q, k, v read the normed embedding half of their input
        layer.update({"self_attn.q_proj.weight": 3 * pick, "self_attn.k_proj.weight": 3 * pick,
                      "self_attn.v_proj.weight": pick, "self_attn.o_proj.weight": eye,
                      "input_layernorm.weight": torch.ones(HIDDEN),
                      "hidden_norm.weight": torch.ones(HIDDEN)})
        targets = torch.tensor(draft_targets())
        tensors = {"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN),
                   "norm.weight": t["model.norm.weight"],
                   "lm_head.weight": t["lm_head.weight"][targets],
                   "d2t": targets - torch.arange(DRAFT_V)}
        cfg.update(num_key_value_heads=HEADS, draft_vocab_size=DRAFT_V, num_aux_hidden_states=2,
                   eagle_aux_hidden_state_layer_ids=[0, 1])
        prefix = "midlayer."
    tensors.update({prefix + k: v for k, v in layer.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def _gemma_args(root: str, mode: str, settings: dict) -> dict:
    """``gemma-none``: the tiny Gemma3 of ``vllm_run.py`` alone; ``gemma-eagle``: beside it, an
    EAGLE drafter written by ``trimpass.train.eagle.save_eagle`` (untrained: its layer passes the
    target's feature through), trimmed."""
    from trimpass.serving import vllm as tv
    target = os.path.join(root, "gemma")
    if not os.path.exists(os.path.join(target, "config.json")):
        vr.make_model(target)
    if mode == "gemma-none":
        return {"model": target}
    drafter = os.path.join(root, "gemma-eagle")
    if not os.path.exists(os.path.join(drafter, "config.json")):
        import torch
        from transformers import Gemma3ForCausalLM

        from trimpass.train.eagle import EagleDrafter, save_eagle
        torch.manual_seed(0)
        save_eagle(EagleDrafter(Gemma3ForCausalLM.from_pretrained(target), heads=2, kv_heads=1,
                                ffn=FFN), drafter)
    return tv.engine_args(target, drafter, vr.K, method="eagle", **settings)


def main() -> None:
    root, mode, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    target = os.path.join(root, "llama")
    if not os.path.exists(os.path.join(target, "config.json")):
        make_target(target)
    from vllm import LLM

    from trimpass.serving import vllm as tv
    if mode.startswith("gemma"):
        args = _gemma_args(root, mode, settings)
    elif mode == "none":
        args = {"model": target}
    else:
        drafter = os.path.join(root, mode)
        if not os.path.exists(os.path.join(drafter, "config.json")):
            make_drafter(drafter, mode, target)
        args = tv.engine_args(target, drafter, vr.K, method=mode, **settings)
    res = vr.greedy_results(LLM(**args, **vr.ENGINE), mode != "none")
    res["draft_targets"] = draft_targets()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
