"""A Hugging Face checkpoint of a causal-LM module, the layout ``from_pretrained`` and vLLM read:
:func:`save_hf` writes ``config.json`` (``architectures`` from the module's class, no quantization
entry, ``tie_word_embeddings`` as in the module) and ``model.safetensors`` (no pickle; a tied head
is stored once, as the embedding). :func:`is_tied` says whether a module's head is its embedding.
"""
from __future__ import annotations

import json
import os


def is_tied(module) -> bool:
    out, inp = module.get_output_embeddings(), module.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def save_hf(module, directory: str) -> str:
    """Write ``module`` as a Hugging Face checkpoint directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    cfg = module.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(module).__name__]
    tied = is_tied(module)
    cfg["tie_word_embeddings"] = tied
    dtype = next(module.parameters()).dtype
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    sd = module.state_dict(keep_vars=True)
    if tied:  # keep the embedding's entry only (safetensors refuses shared storage anyway)
        head_mod = module.get_output_embeddings()
        name = next(n for n, m in module.named_modules() if m is head_mod)
        sd = {k: v for k, v in sd.items() if k != f"{name}.weight"}
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    save_file(sd, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
