"""An EAGLE-style drafter for a Hugging Face target, trained on the target's cached outputs and
last-layer features: at position ``j`` it reads the target's final hidden state ``f_j`` (after its
final norm: what vLLM's EAGLE route passes) and the embedding of token ``j + 1``, mixes them with
``fc`` into one Llama decoder layer (no input norm, as vLLM's ``EagleLlamaForCausalLM``), and scores
the output, without a final norm, with the target's own head (shared and frozen, like the
embedding): its guess for token ``j + 2``, the target's greedy token at position ``j + 1``. The
training-time test (EAGLE-3's idea) runs a second step over the drafter's own outputs, so later
draft positions see what the drafter feeds itself. The losses are the project's (``kl``, ``eal``,
``wtv``) over the columns of an active set (a frequency core plus the batch's target top-k), as
``--core`` trains the truncated drafter; the evaluation is full-vocabulary top-1 agreement with
the target on held-out text. The layer is written as a vLLM EAGLE checkpoint (``save_eagle``):
``LlamaForCausalLM`` with one layer, the target's embedding and head shared, which vLLM 0.32
serves beside a Gemma-3 target on ``method="eagle"``."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from trimpass.train import losses
from trimpass.train.cache import TargetCache
from trimpass.train.trainer import TrainResult, columns, dense_target

__all__ = ["EagleDrafter", "target_features", "target_outputs", "train_eagle", "agreement",
           "save_eagle"]


class EagleDrafter(nn.Module):
    """fc([embedding of token j+1, feature j]) -> one Llama decoder layer -> the target's head."""

    def __init__(self, target, heads: int = 8, kv_heads: int = 2, ffn: int = 2048):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
        d = target.config.hidden_size
        if d % heads:
            raise ValueError(f"heads: {heads} does not divide the target's hidden size {d}")
        self.config = LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=d,
                                  intermediate_size=ffn, num_hidden_layers=1,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  head_dim=d // heads, rms_norm_eps=1e-6,
                                  max_position_embeddings=target.config.max_position_embeddings,
                                  tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        self.config._attn_implementation = "sdpa"
        self.embed = target.get_input_embeddings()  # shared, frozen
        self.head = target.get_output_embeddings()
        for p in (*self.embed.parameters(), *self.head.parameters()):
            p.requires_grad_(False)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(self.config, 0)
        self.layer.input_layernorm = nn.Identity()
        self.rope = LlamaRotaryEmbedding(self.config)
        with torch.no_grad():  # start as the identity on the feature: h = f_j
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()

    def trained(self) -> dict:
        return {"fc." + k: v for k, v in self.fc.state_dict().items()} | \
               {"layer." + k: v for k, v in self.layer.state_dict().items()}

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``next_ids`` [B, S] (token j + 1), ``features`` [B, S, d] (feature j): [B, S, d]."""
        x = self.fc(torch.cat([self.embed(next_ids).to(features.dtype), features], -1))
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return self.layer(x, position_embeddings=self.rope(x, pos), position_ids=pos)

    def logits(self, h: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        W = self.head.weight
        return F.linear(h, (W if cols is None else W[cols]).to(h.dtype))


@torch.no_grad()
def target_features(target, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """The target's final hidden states (after its final norm) over ``ids`` [N, S], bf16."""
    return target_outputs(target, ids, batch=batch, k=0)[1]


@torch.no_grad()
def target_outputs(target, ids: torch.Tensor, *, k: int = 32, temperature: float = 1.0,
                   batch: int = 4, model_key: str = "target"):
    """One pass of ``target`` over ``ids`` [N, S]: its :class:`TargetCache` (top-``k`` logits
    and ids, logsumexp of its full logits / T, greedy tokens; None for ``k=0``) and its final
    hidden states (bf16), the cache's logits taken from those states with the target's head (and
    its final soft-cap), so the body runs once."""
    from trimpass.ops import softcap
    from trimpass.progress import progress
    cap = getattr(target.config, "final_logit_softcapping", None) or 0.0
    W = target.get_output_embeddings().weight
    feats, out = [], {n: [] for n in ("vals", "ids", "lse")}
    for i in progress(range(0, len(ids), batch), desc="target outputs", unit="batch"):
        h = target.model(input_ids=ids[i:i + batch]).last_hidden_state
        feats.append(h.to(torch.bfloat16))
        if k:
            z = softcap(F.linear(h, W), cap).float()
            v, j = z.topk(k, -1)
            out["vals"].append(v)
            out["ids"].append(j)
            out["lse"].append(torch.logsumexp(z / temperature, -1))
    if not k:
        return None, torch.cat(feats)
    tids = torch.cat(out["ids"])
    cache = TargetCache(ids.long(), torch.cat(out["vals"]), tids, torch.cat(out["lse"]),
                        tids[..., 0].clone(), W.shape[0], float(temperature), model_key)
    return cache, torch.cat(feats)


def _step_loss(drafter, h, cache_rows, loss, gamma, T, active, V):
    vals, tids, lse, greedy = cache_rows
    cols = columns(tids, active)
    d = drafter.logits(h, cols).float()
    if loss == "eal":
        return losses.eal_loss(d, greedy if cols is None else torch.searchsorted(cols, greedy),
                               gamma)
    tgt = dense_target(vals, tids, cols, V)
    if loss == "kl":
        return losses.kl_loss(d, tgt, T, target_lse=lse)
    return losses.wtv_loss(d, tgt, gamma, T, target_lse=lse)


def _steps(drafter, ids, feats, ttt: int):
    """The drafter's hidden states for ``ttt`` chained steps: step s at position j guesses token
    j + s + 1 from the step before's output (step 1: the target's feature)."""
    out, f = [], feats[:, :-1]
    for s in range(1, ttt + 1):
        h = drafter(ids[:, s:], f[:, :ids.shape[1] - s])
        out.append(h)
        f = h[:, :-1]
    return out


def train_eagle(drafter: EagleDrafter, cache: TargetCache, feats: torch.Tensor, *, tokens: int,
                loss: str = "kl", gamma: int = 4, temperature: float = 1.0, lr: float = 1e-3,
                batch: int = 8, ttt: int = 2, core: int = 4096, seed: int = 0, every: int = 0,
                on_eval=None) -> dict:
    """Train the drafter's fc and layer for ``tokens`` training positions; every ``every``
    tokens (0: only at the end) call ``on_eval(tokens_so_far)``. Returns the settings and wall
    time. bf16 autocast (this CPU's AMX); fp32 master weights and losses."""
    if loss not in ("kl", "eal", "wtv"):
        raise ValueError(f"loss: {loss!r}; use kl, eal or wtv")
    if ttt < 1:
        raise ValueError(f"ttt: {ttt}; at least 1 step")
    V = cache.vocab_size
    active = torch.bincount(cache.ids.reshape(-1), minlength=V).topk(core).indices if core \
        else None
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    N, S = cache.ids.shape
    per_step = batch * (S - 1)
    steps = max(1, tokens // per_step)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    seen, next_eval, t0, curve = 0, every or None, time.perf_counter(), []
    from trimpass.progress import progress
    for _ in progress(range(steps), desc="eagle drafter", unit="step"):
        idx = torch.randint(0, N, (batch,), generator=g)
        ids, f = cache.ids[idx], feats[idx].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hs = _steps(drafter, ids, f, ttt)
            total = 0.0
            for s, h in enumerate(hs, start=1):
                rows = (cache.topk_logits[idx, s:], cache.topk_ids[idx, s:], cache.lse[idx, s:],
                        cache.greedy[idx, s:])
                total = total + 0.8 ** (s - 1) * _step_loss(drafter, h, rows, loss, gamma,
                                                            temperature, active, V)
        opt.zero_grad(set_to_none=True)
        total.backward()
        curve.append(float(total.detach()))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += per_step
        if next_eval and seen >= next_eval and on_eval is not None:
            on_eval(seen)
            next_eval += every
    if on_eval is not None and (not every or seen % every):
        on_eval(seen)
    return {"steps": steps, "tokens": seen, "wall_s": time.perf_counter() - t0, "loss": loss,
            "lr": lr, "batch": batch, "ttt": ttt, "core": core, "losses": curve}


@torch.no_grad()
def agreement(drafter: EagleDrafter, cache: TargetCache, feats: torch.Tensor, ttt: int = 2,
              batch: int = 4) -> list[float]:
    """Full-vocabulary top-1 agreement with the target's greedy token per chained step (step 1:
    the first drafted token, from the target's feature; step 2 from the drafter's own output,
    counted where step 1 agreed), on ``cache``'s (held-out) sequences."""
    hit = [0] * ttt
    n = [0] * ttt
    for i in range(0, len(cache.ids), batch):
        ids, f = cache.ids[i:i + batch], feats[i:i + batch].float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hs = _steps(drafter, ids, f, ttt)
        ok = None
        for s, h in enumerate(hs, start=1):
            right = drafter.logits(h).argmax(-1) == cache.greedy[i:i + batch, s:]
            if ok is not None:  # the chain: step s counts where step s - 1 agreed
                ok = ok[:, :right.shape[1]]
                right, mask = right & ok, ok
            else:
                mask = torch.ones_like(right)
            hit[s - 1] += int(right.sum())
            n[s - 1] += int(mask.sum())
            ok = right
    return [h / max(c, 1) for h, c in zip(hit, n, strict=True)]


def save_eagle(drafter: EagleDrafter, directory: str) -> str:
    """The trained layer as a vLLM EAGLE checkpoint (``method="eagle"``): ``config.json``
    (``LlamaForCausalLM``, one layer) and ``model.safetensors`` with ``fc`` (the embedding's scale,
    e.g. Gemma's sqrt(d), folded into its embedding half) and ``layers.0``; no embedding or head
    (vLLM shares the target's)."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    # vLLM's EAGLE drafter reads the target's embedding table unscaled (vLLM's Gemma scales in its
    # model's forward, which the drafter does not run): the scale moves into fc's embedding half
    d = drafter.config.hidden_size
    fc = drafter.fc.weight.detach().clone()
    fc[:, :d] *= float(getattr(drafter.embed, "embed_scale", 1.0))
    tensors = {"fc.weight": fc}
    tensors |= {f"layers.0.{k}": v for k, v in drafter.layer.state_dict().items()}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"))
    cfg = drafter.config.to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return directory


def run_cli(args):
    """``python -m trimpass train --drafter eagle``: the real Gemma-3-270M's outputs and final
    hidden states over ShareGPT's train split (one pass), then the EAGLE-style drafter trained
    on them and written to ``OUT/eagle`` as a vLLM EAGLE checkpoint."""
    from trimpass.hf.gemma import END_TURN, GGUFTokenizer
    from trimpass.models import gemma3_270m
    from trimpass.train.data import sharegpt_sequences
    seqs = sharegpt_sequences(GGUFTokenizer(), seq_len=args.seq_len,
                              tokens=args.data_tokens or args.tokens, eos=END_TURN)
    target = gemma3_270m(torch.float32 if args.cache_dtype == "fp32" else torch.bfloat16)
    cache, feats = target_outputs(target, seqs, temperature=args.temperature,
                                  model_key=f"gemma3-270m-q4_k_m/{args.cache_dtype}")
    torch.manual_seed(args.seed)
    drafter = EagleDrafter(target)
    info = train_eagle(drafter, cache, feats, tokens=args.tokens, loss=args.loss,
                       gamma=args.gamma, temperature=args.temperature, lr=args.lr or 1e-3,
                       batch=args.batch, ttt=args.ttt, core=args.core, seed=args.seed)
    out = save_eagle(drafter, os.path.join(args.out, "eagle"))
    return TrainResult(info["steps"], info["tokens"], info["wall_s"],
                       info["tokens"] / max(info["wall_s"], 1e-9), args.out, out, info["losses"])
