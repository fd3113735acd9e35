"""What row-invariant verification (:mod:`trimpass.hf.exact`) costs the real Gemma-3-270M in bf16,
and that it is exact.

For k = 1 .. ``--max-tokens`` new tokens after a KV cache of ``--prompt-len`` positions (cropped
back after every pass, so all passes are alike): the median ms of one forward of the plain model
(``sdpa``) and of the row-invariant one, interleaved in one run (``trimpass.measure``), and whether
the row-invariant pass over k tokens equals k one-token steps bit for bit (and the plain one's).
``--dtype fp32`` times the plain model alone (fp32 cannot be made row-invariant on this CPU), to
show what verifying k tokens costs there. ``OMP_WAIT_POLICY=PASSIVE`` is set before torch loads,
as in ``bench/step_cost.py``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os


def _step(model, cache, x) -> None:
    model(x, past_key_values=cache)
    cache.crop(-x.shape[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=5)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import DynamicCache

    from trimpass import measure
    from trimpass.hf import exact
    from trimpass.hf.gemma import load_model

    torch.manual_seed(0)
    plain = load_model(torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    made = None
    if a.dtype == "bf16":
        made = copy.deepcopy(plain)
        exact.use(made)
    models = {"plain": plain, "row-invariant": made} if made is not None else {"plain": plain}
    ids = torch.randint(3, 50_000, (1, a.prompt_len + a.max_tokens))
    prompt = ids[:, :a.prompt_len]

    def cached(model):
        c = DynamicCache(config=model.config)
        model(prompt, past_key_values=c)
        return c

    def one_pass_equals_steps(model, k):
        c = cached(model)
        together = model(ids[:, a.prompt_len:a.prompt_len + k], past_key_values=c).logits[0]
        c = cached(model)
        steps = [model(ids[:, j:j + 1], past_key_values=c).logits[0]
                 for j in range(a.prompt_len, a.prompt_len + k)]
        return torch.equal(together, torch.cat(steps))

    print(f"Gemma-3-270M {a.dtype}, cache {a.prompt_len}, median ms of one forward "
          f"({torch.get_num_threads()} threads)\n")
    names = list(models)
    print("| tokens | " + " | ".join(f"{n} ms" for n in names) + " | ratio to 1 token | "
          + " | ".join(f"exact: {n}" for n in names) + " |")
    print("|---" * (2 + 2 * len(names)) + "|")
    first = {}
    with torch.no_grad():
        caches = {n: cached(m) for n, m in models.items()}
        for k in range(1, a.max_tokens + 1):
            x = ids[:, a.prompt_len:a.prompt_len + k]
            ms = measure.interleaved_ms(
                {n: functools.partial(_step, m, caches[n], x) for n, m in models.items()},
                rounds=a.rounds, calls=1)
            first = first or ms
            ok = ["n/a" if k == 1 else ("✓" if one_pass_equals_steps(m, k) else "✗")
                  for m in models.values()]
            ratio = " / ".join(f"{ms[n] / first[n]:.2f}" for n in names)
            print(f"| {k} | " + " | ".join(f"{ms[n]:.1f}" for n in names) + f" | {ratio} | "
                  + " | ".join(ok) + " |", flush=True)


if __name__ == "__main__":
    main()
