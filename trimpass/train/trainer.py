"""Drafter training that optimizes acceptance length, from a target-output cache (``cache.py``).
:func:`train` fits the drafter's last ``train_layers`` decoder layers and its final norm (the
embedding, the head and the earlier layers stay frozen) with one of the losses of ``losses.py``:
``kl`` (distillation), ``eal`` (expected accepted length, greedy verification) or ``wtv`` (the same
under speculative sampling). With ``active`` ids the drafter's logits are computed over a column
subset only, the batch's cached target top-k ids ∪ the active ids, and the target keeps its full
logsumexp, so training sees the trimmed head it will run with. ``grpo=True`` adds a GRPO stage:
G draft windows sampled per context (teacher-forced prefix from the data), rewarded by their
greedy accepted length against the target's cached greedy tokens (exact when the data is the
target's own greedy text), group-normalized advantages and a KL penalty to a frozen copy of the
drafter taken at the start of the stage. Budgets are in tokens (batch x seq_len per step); every
random choice (data order, contexts, samples) comes from a generator seeded by (seed, step), so a
run resumed from its checkpoint (trainable parameters, optimizer state and the GRPO reference as
safetensors, step and settings as JSON: no pickle) is bit-for-bit the uninterrupted run. Bad input
raises ``ValueError`` before any compute, with nothing written.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from trimpass.base import softcap
from trimpass.progress import progress
from trimpass.train import losses, lowrank
from trimpass.train.cache import TargetCache, load_cache

__all__ = ["train", "evaluate", "TrainResult", "LOSSES"]

LOSSES = ("kl", "eal", "wtv")
CKPT, META, WEIGHTS = "checkpoint.safetensors", "checkpoint.json", "drafter.safetensors"


@dataclass
class TrainResult:
    steps: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    out_dir: str
    weights: str
    losses: list = field(default_factory=list)
    rewards: list = field(default_factory=list)


def _int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def _pos(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def _vocab(drafter) -> int:
    return drafter.get_output_embeddings().weight.shape[0]


def _check_active(active, V):
    if active is None:
        return None
    if not isinstance(active, torch.Tensor) or active.dim() != 1 or active.is_floating_point() \
            or active.dtype == torch.bool:
        raise ValueError("active must be a 1-D int tensor of token ids (the active vocabulary)")
    if active.numel() == 0:
        raise ValueError("active is empty: pass at least one id (or None for the full vocabulary)")
    if int(active.min()) < 0 or int(active.max()) >= V:
        raise ValueError(f"active ids must be in [0, V={V}), got values in "
                         f"[{int(active.min())}, {int(active.max())}]")
    return active.long().unique()


# ---------------------------------------------------------------- logits over columns
def draft_logits(drafter, ids, cols):
    """The drafter's head over ``cols`` (sorted ids) or the full vocabulary (None), [B, S, C]."""
    h = drafter.model(input_ids=ids).last_hidden_state
    W = drafter.get_output_embeddings().weight
    logits = torch.nn.functional.linear(h, W if cols is None else W[cols])
    cap = getattr(drafter.config, "final_logit_softcapping", None)
    return softcap(logits, cap or 0.0)


def columns(topk_ids, active):
    """The trained columns: the active set plus every cached top-k id (None: the full head)."""
    return None if active is None else torch.unique(torch.cat([active, topk_ids.reshape(-1)]))


def dense_target(topk_vals, topk_ids, cols, V):
    """The cached top-k logits placed over ``cols`` (or all V), -inf elsewhere."""
    B, S, _ = topk_ids.shape
    pos = topk_ids if cols is None else torch.searchsorted(cols, topk_ids)
    out = torch.full((B, S, V if cols is None else len(cols)), -math.inf)
    return out.scatter_(-1, pos, topk_vals)


def _batch(cache, idx, seq_len):
    return (cache.ids[idx, :seq_len], cache.topk_logits[idx, :seq_len],
            cache.topk_ids[idx, :seq_len], cache.lse[idx, :seq_len], cache.greedy[idx, :seq_len])


def _base_loss(drafter, batch, loss, gamma, T, active, V):
    ids, vals, tids, lse, greedy = batch
    cols = columns(tids, active)
    d = draft_logits(drafter, ids, cols)
    if loss == "eal":
        index = greedy if cols is None else torch.searchsorted(cols, greedy)
        return losses.eal_loss(d, index, gamma)
    tgt = dense_target(vals, tids, cols, V)
    if loss == "kl":
        return losses.kl_loss(d, tgt, T, target_lse=lse)
    return losses.wtv_loss(d, tgt, gamma, T, target_lse=lse)


def _grpo_loss(drafter, ref, batch, gen, gamma, T, active, G, kl_coef):
    ids, _, tids, _, greedy = batch
    B, S = ids.shape
    cols = columns(tids, active)
    i = int(torch.randint(0, S - gamma + 1, (1,), generator=gen))
    seq = ids[:, :i + 1].repeat_interleave(G, 0)
    drafted = []
    with torch.no_grad():
        for _ in range(gamma):
            q = torch.softmax(draft_logits(drafter, seq, cols)[:, -1].float() / T, -1)
            c = torch.multinomial(q, 1, generator=gen)
            drafted.append(c)
            seq = torch.cat([seq, c if cols is None else cols[c]], 1)
    dc = torch.cat(drafted, 1).unsqueeze(-1)

    def logp(model):
        lg = draft_logits(model, seq[:, :-1], cols)[:, i:].float() / T
        return torch.log_softmax(lg, -1).gather(-1, dc).squeeze(-1).view(B, G, gamma)

    new = logp(drafter)
    with torch.no_grad():
        old = logp(ref)
    acc = losses.simulate_greedy(seq[:, i + 1:].reshape(B, G, gamma), greedy[:, i:i + gamma])
    mask = torch.arange(gamma) <= acc.unsqueeze(-1)  # tokens up to the first rejection
    adv = losses.group_advantages(acc.float())
    return losses.grpo_objective(new, new.detach(), old, adv, mask, kl_coef=kl_coef), acc


@torch.no_grad()
def evaluate(drafter, cache: TargetCache, *, loss="eal", gamma=4, temperature=1.0, active=None,
             rows=None, seq_len=None) -> float:
    """The base loss of ``drafter`` on the cache's first ``rows`` sequences (no training)."""
    idx = torch.arange(len(cache.ids) if rows is None else min(rows, len(cache.ids)))
    active = _check_active(active, _vocab(drafter))
    b = _batch(cache, idx, seq_len or cache.ids.shape[1])
    return float(_base_loss(drafter, b, loss, gamma, float(temperature), active, _vocab(drafter)))


# ---------------------------------------------------------------- checkpoints (safetensors + JSON)
def _write_ckpt(out_dir, step, settings, named, opt, ref):
    from safetensors.torch import save_file
    t = {f"param.{n}": p.detach().clone() for n, p in named}
    for j, (_, p) in enumerate(named):
        for k, v in opt.state.get(p, {}).items():
            t[f"opt.{j}.{k}"] = v.detach().clone().reshape(-1) if v.dim() == 0 else v.detach()
    if ref is not None:
        t.update({f"ref.{n}": p.detach().clone() for n, p in ref})
    save_file(t, os.path.join(out_dir, CKPT + ".part"))
    with open(os.path.join(out_dir, META + ".part"), "w") as f:
        json.dump({"step": step, "settings": settings}, f, indent=1, sort_keys=True)
    os.replace(os.path.join(out_dir, CKPT + ".part"), os.path.join(out_dir, CKPT))
    os.replace(os.path.join(out_dir, META + ".part"), os.path.join(out_dir, META))


def _read_ckpt(out_dir, settings, names):
    from safetensors.torch import load_file
    meta_path, path = os.path.join(out_dir, META), os.path.join(out_dir, CKPT)
    fix = "delete it (or train with resume=False / into another --out)"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        step, saved = int(meta["step"]), meta["settings"]
    except Exception as e:
        raise ValueError(f"checkpoint {meta_path} is corrupt ({type(e).__name__}: {e}); {fix}") \
            from None
    if saved != settings:
        diff = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise ValueError(f"checkpoint {meta_path} was written with other settings ({diff}); {fix}")
    try:
        t = load_file(path)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is corrupt ({type(e).__name__}: {e}); {fix}") \
            from None
    if any(f"param.{n}" not in t for n in names):
        raise ValueError(f"checkpoint {path} lacks parameters of this drafter; {fix}")
    return step, t


def _restore(t, named, opt, ref_named):
    with torch.no_grad():
        for n, p in named:
            p.copy_(t[f"param.{n}"])
        if ref_named is not None and f"ref.{named[0][0]}" in t:
            for n, p in ref_named:
                p.copy_(t[f"ref.{n}"])
    state = {}
    for j in range(len(named)):
        s = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"opt.{j}.")}
        if "step" in s:
            s["step"] = s["step"].reshape(())
        if s:
            state[j] = s
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def _frozen_copy(drafter, trainable):
    keep = {id(p): p for p in drafter.parameters() if all(p is not q for q in trainable)}
    return copy.deepcopy(drafter, keep)  # shares the frozen tensors, copies the trained ones


# ---------------------------------------------------------------- the loop
def _checked(drafter, target_cache, loss, gamma, temperature, tokens, lr, batch, seq_len, active,
             train_layers, group, ckpt_every, lora_rank):
    """:func:`train`'s arguments checked before any compute: ``(target_cache, V, seq_len, active,
    gamma, tokens, batch, T, lr, group, ckpt_every)``."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    gamma, tokens, batch = _int("gamma", gamma), _int("tokens", tokens), _int("batch", batch)
    T, lr = _pos("temperature", temperature), _pos("lr", lr)
    group, ckpt_every = _int("group", group), _int("ckpt_every", ckpt_every)
    if isinstance(target_cache, str):
        target_cache = load_cache(target_cache)
    if not isinstance(target_cache, TargetCache):
        raise ValueError("target_cache must be a TargetCache or the path of its file")
    V = _vocab(drafter)
    if V != target_cache.vocab_size:
        raise ValueError(f"drafter and target vocabularies differ: the drafter's head has "
                         f"{V} rows, the target cache {target_cache.vocab_size}")
    S_cache = target_cache.ids.shape[1]
    seq_len = S_cache if seq_len is None else _int("seq_len", seq_len)
    if seq_len > S_cache:
        raise ValueError(f"seq_len={seq_len} is longer than the cached sequences ({S_cache})")
    if gamma > seq_len:
        raise ValueError(f"gamma={gamma} is larger than seq_len={seq_len}")
    if loss != "eal" and T != target_cache.temperature:
        raise ValueError(f"temperature={T} differs from the target cache's "
                         f"({target_cache.temperature}): its logsumexp is at that temperature")
    active = _check_active(active, V)
    _int("train_layers", train_layers)
    _int("lora_rank", lora_rank, lo=0)
    if train_layers > len(drafter.model.layers):
        raise ValueError(f"train_layers={train_layers} exceeds the drafter's "
                         f"{len(drafter.model.layers)} layers")
    return target_cache, V, seq_len, active, gamma, tokens, batch, T, lr, group, ckpt_every


def _trainable(drafter, train_layers: int, lora_rank: int) -> list:
    """The parameters trained: the last ``train_layers`` layers (or LoRA adapters of them, injected
    here, and their norms) and the final norm."""
    layers = drafter.model.layers
    tuned = layers[len(layers) - train_layers:]
    if lora_rank:
        norms = [p for n, p in tuned.named_parameters() if "norm" in n]
        return [*lowrank.add_lora(drafter, lora_rank, train_layers), *norms,
                *drafter.model.norm.parameters()]
    return [*tuned.parameters(), *drafter.model.norm.parameters()]


class _Rows:
    """The cache rows of each step: a fresh seeded permutation of the N rows every epoch, so a
    resumed run draws the same batches."""

    def __init__(self, N: int, batch: int, seed: int):
        self.N, self.batch, self.seed, self.perms = N, batch, seed, {}

    def __call__(self, step: int) -> torch.Tensor:
        out = []
        for x in range(step * self.batch, (step + 1) * self.batch):
            e = x // self.N
            if e not in self.perms:
                self.perms[e] = torch.randperm(self.N, generator=torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + e) % 2**63))
            out.append(int(self.perms[e][x % self.N]))
        return torch.tensor(out)


def train(drafter, target_cache, *, loss="kl", grpo=False, gamma=4, temperature=1.0,
          tokens=100_000, lr=1e-4, batch=4, seq_len=None, seed=0, out_dir="train-out",
          resume=True, active=None, train_layers=1, grpo_tokens=None, group=4, kl_coef=0.05,
          ckpt_every=50, lora_rank=0) -> TrainResult:
    """Train ``drafter`` (an HF causal LM, e.g. ``trimpass.models.gemma3_270m_drafter()``) in
    place against ``target_cache`` (a :class:`TargetCache` or its file); see the module docstring.
    Writes ``out_dir``/drafter.safetensors (the trained parameters, for ``weights=``) and the
    checkpoint; returns a :class:`TrainResult` (steps, tokens, wall time, tokens/s, losses).
    ``lora_rank`` > 0 trains rank-``lora_rank`` adapters of those layers (``lowrank.py``) and
    their norms instead of the full layers, writes the adapters in the small low-rank format, and
    leaves them folded into ``drafter`` when it returns."""
    target_cache, V, seq_len, active, gamma, tokens, batch, T, lr, group, ckpt_every = _checked(
        drafter, target_cache, loss, gamma, temperature, tokens, lr, batch, seq_len, active,
        train_layers, group, ckpt_every, lora_rank)
    kl_coef = float(kl_coef)
    per_step = batch * seq_len
    base_steps = -(-tokens // per_step)
    grpo_steps = (-(-(grpo_tokens or max(tokens // 4, 1)) // per_step)) if grpo else 0
    total = base_steps + grpo_steps
    trainable = _trainable(drafter, train_layers, lora_rank)
    named = [(n, p) for n, p in drafter.named_parameters() if any(p is q for q in trainable)]
    settings = {"loss": loss, "grpo": bool(grpo), "gamma": gamma, "temperature": T, "lr": lr,
                "batch": batch, "seq_len": seq_len, "seed": int(seed), "cache": target_cache.key,
                "train_layers": train_layers, "group": group, "kl_coef": kl_coef,
                "lora_rank": lora_rank,
                "base_steps": base_steps if grpo else None, "vocab_size": V,
                "active": None if active is None else
                hashlib.sha256(active.numpy().tobytes()).hexdigest()[:16]}
    opt = torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=0.0)
    start = 0
    ckpt = None
    if resume and os.path.exists(os.path.join(out_dir, META)):
        try:  # before any compute
            start, ckpt = _read_ckpt(out_dir, settings, [n for n, _ in named])
        except ValueError:
            if lora_rank:
                lowrank.unload(drafter)
            raise
    ref = ref_named = None
    if ckpt is not None:
        if start > base_steps:
            ref = _frozen_copy(drafter, trainable)
            ref_named = [(n, p) for n, p in ref.named_parameters() if f"ref.{n}" in ckpt]
        _restore(ckpt, named, opt, ref_named)
    os.makedirs(out_dir, exist_ok=True)
    flags = {id(p): p.requires_grad for p in drafter.parameters()}
    for p in drafter.parameters():
        p.requires_grad_(any(p is q for q in trainable))

    rows = _Rows(target_cache.ids.shape[0], batch, seed)
    res = TrainResult(start, start * per_step, 0.0, 0.0, out_dir, os.path.join(out_dir, WEIGHTS))
    t0 = time.perf_counter()
    bar = progress(range(start, total), desc=f"train {loss}", total=total - start)
    try:
        for step in bar:
            b = _batch(target_cache, rows(step), seq_len)
            if step < base_steps:
                value = _base_loss(drafter, b, loss, gamma, T, active, V)
            else:
                if ref is None:  # the stage's frozen reference: the drafter as the stage starts
                    ref = _frozen_copy(drafter, trainable)
                    ref_named = [(n, p) for n, p in ref.named_parameters()
                                 if any(n == m for m, _ in named)]
                gen = torch.Generator().manual_seed((seed * 1_000_003 + 7919 * step) % 2**63)
                value, acc = _grpo_loss(drafter, ref, b, gen, gamma, T, active, group, kl_coef)
                res.rewards.append(float(acc.float().mean()))
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
            res.losses.append(float(value.detach()))
            res.steps, res.tokens = step + 1, (step + 1) * per_step
            el = time.perf_counter() - t0
            bar.set_postfix(loss=f"{res.losses[-1]:.4f}",
                            tok_s=f"{(step + 1 - start) * per_step / max(el, 1e-9):.0f}")
            if (step + 1) % ckpt_every == 0 or step + 1 == total:
                _write_ckpt(out_dir, step + 1, settings, named, opt, ref_named)
    finally:
        for p in drafter.parameters():
            p.requires_grad_(flags[id(p)])
    res.wall_s = time.perf_counter() - t0
    res.tokens_per_s = (res.steps - start) * per_step / max(res.wall_s, 1e-9)
    from safetensors.torch import save_file
    weights = {n: p.detach().clone() for n, p in named if "lora_" not in n}
    if lora_rank:
        weights.update(lowrank.lowrank_tensors(drafter))
        lowrank.unload(drafter)
    save_file(weights, res.weights, metadata={
        "format": "pt", "settings": json.dumps(settings), "step": str(res.steps)})
    return res


def run_cli(args) -> TrainResult:
    """``python -m trimpass train``: the real Gemma-3-270M target and its truncated drafter."""
    args.lr = args.lr or 1e-4
    from trimpass.hf.gemma import END_TURN, GGUFTokenizer
    from trimpass.models import drafter_from, gemma3_270m, load_weights, save_hf
    from trimpass.train.cache import build_cache
    from trimpass.train.data import sharegpt_sequences
    for name in ("tokens", "seq_len", "layers"):  # cheap checks before loading anything
        _int(name, getattr(args, name))
    rank = _int("lora_rank", getattr(args, "lora_rank", 0), lo=0)
    _int("core", getattr(args, "core", 0), lo=0)
    cache_dtype = getattr(args, "cache_dtype", "fp32")
    _pos("temperature", args.temperature)
    init = getattr(args, "init", None)
    if init and not os.path.isfile(init):
        raise ValueError(f"init: no such file {init!r}; pass a drafter.safetensors written by "
                         "an earlier `python -m trimpass train`")
    seqs = sharegpt_sequences(GGUFTokenizer(), seq_len=args.seq_len,
                              tokens=args.data_tokens or args.tokens, eos=END_TURN)
    target = gemma3_270m()
    teacher = target if cache_dtype == "fp32" else gemma3_270m(torch.bfloat16)
    cache = build_cache(teacher, seqs, model_key=f"gemma3-270m-q4_k_m/{cache_dtype}", k=32,
                        temperature=args.temperature)
    core = _int("core", getattr(args, "core", 0), lo=0)
    active = None if not core else \
        torch.bincount(cache.ids.reshape(-1), minlength=cache.vocab_size).topk(core).indices
    drafter = drafter_from(target, args.layers)
    if init:
        load_weights(drafter, init)
    r = train(drafter, cache, loss=args.loss, grpo=args.grpo, gamma=args.gamma,
              temperature=args.temperature, tokens=args.tokens, grpo_tokens=args.grpo_tokens,
              lr=args.lr, batch=args.batch, seq_len=args.seq_len, seed=args.seed,
              out_dir=args.out, resume=not args.no_resume, train_layers=args.train_layers,
              lora_rank=rank, active=active)
    if args.export_hf:
        save_hf(drafter, os.path.join(args.out, "hf"))
    return r
