"""GPU check: the trimmed LM-head op on a CUDA device, bf16, against copy bandwidth and cuBLAS.

On a bare CUDA machine with torch and triton but no network, from the repository root:
    bench/gpu_run.sh OUTDIR     (installs the wheel, then runs this script with --out OUTDIR)
Every check asserts its tolerance: one line per check, then a closing summary line
``gpu_check: N passed, N failed, N skipped``; the exit status is 1 if any check failed (a section
that raises counts as a failed check, and the others still run), 2 without a CUDA device or
without trimpass installed. Correctness: the kernel's logits against a float32 reference, ``-inf``
past the device-side count and on inactive ids, float32 logits within 1e-5 of a float64 reference
(no TF32), the state update with no host sync that admits every received id (eager and replayed
in a CUDA graph, <= 20 us either way), and per drafter shape (``bench/gpu_step.py``: EAGLE-3 for
Llama-3-8B and Gemma-3-270M, random weights, ``mode="reduce-overhead"``) a trimmed step that matches
the untrimmed one on its active ids, whose graph CUDA-graph trees see with every weight static.
Speed (GPU only): every shape of ``bench/kernel_roofline.py`` (four heads, K = 1k/3k/32k,
M = 1/4/16/64, bf16), the trimmed head and cuBLAS's full head each timed in a CUDA graph, printed
beside the predicted time; checks that one request at K = 3,000 gives 132 programs or more work,
that the trimmed head beats the full one at M = 1, that the median measured/predicted ratio lies
within 0.5-2; the host time of an eager ``head_compact`` call (<= 15 us); per drafter shape, the
trimmed step against the untrimmed one (<= 0.5x for EAGLE, <= 0.6x for Gemma) and no weight-sized
copy per replay (profiler). The fused loop (``bench/gpu_fused.py``): its output equals plain
decoding through the same body, with CUDA graphs, and its tokens/s beside plain decoding's.
``--dry-run`` runs every section on the CPU under the Triton interpreter at tiny sizes (CI does, so
the script cannot rot): the correctness checks are asserted, the speed checks skipped (its numbers
mean nothing), and a self-check first plants failures to prove they are counted and fail the run.
``--inject-failure`` plants one failing check in a real run, to see the failure path end to end.
Each section prints its seconds, and with ``--out`` the JSON is rewritten after every section.
The whole script stays under 5 minutes on an H200. ``bench/gpu_run.sh OUTDIR`` is the one command
for a GPU machine: it installs the wheel and runs this script with its log teed into ``OUTDIR``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny sizes")
    p.add_argument("--out", default=None, help="directory for gpu_check.json")
    p.add_argument("--inject-failure", action="store_true",
                   help="plant one failing check (the run must then exit 1)")
    return p.parse_args()


ARGS = _args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (trimpass imports it)
try:
    import kernel_roofline  # beside this script
    import torch
    import torch.nn.functional as F

    import trimpass  # noqa: F401  (installed? else exit 2)
    from trimpass import measure, ops
    from trimpass.shapes import DRAFTERS
except ImportError as e:
    print(f"gpu_check: cannot import {e.name}; install trimpass first (from the repository root: "
          "bench/gpu_run.sh OUTDIR on a GPU, pip install --no-deps --no-build-isolation . "
          "elsewhere)", file=sys.stderr)
    sys.exit(2)
try:
    from trimpass.kernels import require_triton
    require_triton()  # the dry run: also whether this triton's interpreter runs with this numpy
except RuntimeError as e:
    print(f"gpu_check: {e}", file=sys.stderr)
    sys.exit(2)

DEVICE = "cpu" if ARGS.dry_run else "cuda"
DTYPE = torch.float32 if ARGS.dry_run else torch.bfloat16
EAGLE = DRAFTERS["eagle-llama3-8b"]  # the real shape the GPU sections time (V, d, heads, ffn)
# max |error| / max |reference|: bf16 logits round to 2^-8 relative; float32 only reorders sums
HEAD_TOL = 1e-2 if DTYPE is torch.bfloat16 else 1e-4
STEP_TOL = 3e-2 if DTYPE is torch.bfloat16 else 1e-4  # a whole drafter step, two compilers


# ---- checks ------------------------------------------------------------------------------------
@dataclass
class Check:
    name: str
    status: str  # "pass", "FAIL" or "skip"
    detail: str


class Checks:
    """Every check of a run, printed as it is made; ``exit_code`` is 1 if any failed."""

    def __init__(self, echo: bool = True):
        self.rows: list[Check] = []
        self.echo = echo

    def _add(self, name: str, status: str, detail: str) -> bool:
        self.rows.append(Check(name, status, detail))
        if self.echo:
            print(f"[{status}] {name}" + (f": {detail}" if detail else ""), flush=True)
        return status == "pass"

    def check(self, name: str, ok, detail: str = "") -> bool:
        return self._add(name, "pass" if bool(ok) else "FAIL", detail)

    def within(self, name: str, value: float, tol: float, what: str = "rel err") -> bool:
        """Passes when ``value <= tol``; NaN and infinity fail."""
        value = float(value)
        return self.check(name, math.isfinite(value) and value <= tol,
                          f"{what} {value:.2e} (tolerance {tol:.0e})")

    def skip(self, name: str, why: str) -> None:
        self._add(name, "skip", why)

    def section(self, name: str, fn):
        """Run ``fn(self)``; an exception is a failed check, and the run goes on."""
        try:
            return fn(self)
        except Exception as e:  # noqa: BLE001 - any crash of a section is a failure to report
            if self.echo:
                traceback.print_exc()
            self.check(f"{name} section ran to the end", False, f"{type(e).__name__}: {e}")
            return []

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    def summary(self) -> str:
        return (f"gpu_check: {self.count('pass')} passed, {self.count('FAIL')} failed, "
                f"{self.count('skip')} skipped")

    def exit_code(self) -> int:
        return 1 if self.count("FAIL") else 0


def self_check() -> list[str]:
    """The failure path, checked on itself: a value past its tolerance, a NaN and a section that
    raises must each count as a failure and make the exit code 1; a clean set must exit 0."""
    c = Checks(echo=False)
    c.within("past its tolerance", 2e-3, 1e-3)
    c.within("NaN", float("nan"), 1e-3)
    c.section("raising", lambda _: 1 / 0)
    c.within("within its tolerance", 1e-5, 1e-3)
    c.skip("skipped", "dry run")
    problems = []
    got = (c.count("pass"), c.count("FAIL"), c.count("skip"))
    if got != (1, 3, 1):
        problems.append(f"counted {got} (pass, fail, skip), expected (1, 3, 1)")
    if c.exit_code() != 1:
        problems.append(f"exit code {c.exit_code()} with failures, expected 1")
    if c.summary() != "gpu_check: 1 passed, 3 failed, 1 skipped":
        problems.append(f"summary {c.summary()!r}")
    clean = Checks(echo=False)
    clean.within("fine", 0.0, 1e-3)
    clean.check("true", True)
    if clean.exit_code() != 0 or clean.count("pass") != 2:
        problems.append("a clean run does not exit 0")
    return problems


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@contextlib.contextmanager
def host_sync_guard():
    """Raise on any host sync inside: CUDA's sync debug mode on a GPU; on the CPU (dry run),
    :mod:`trimpass.testing.nosync`'s dispatch mode with the Triton path forced, as a GPU would run
    it."""
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    from trimpass.testing.nosync import no_host_sync
    with ops.use_kernel("triton"), no_host_sync():
        yield


def bench_ms(fn) -> float:
    """Median ms per call: triton's do_bench on CUDA (100 ms of repetitions), torch's benchmark
    Timer on the dry run's CPU (a short run: its numbers mean nothing)."""
    return measure.median_ms(fn, DEVICE, min_time_s=0.1 if DEVICE == "cuda" else 0.02)


# ---- sections ----------------------------------------------------------------------------------
def head_section(c: Checks) -> list[dict]:
    """Correctness of the kernel on the EAGLE head: compact and full logits, ``-inf`` past a
    device-side count and on inactive ids; float32 logits against a float64 reference."""
    V, d = EAGLE.head if DEVICE == "cuda" else (1_031, 96)
    ks = (3_000, 32_000) if DEVICE == "cuda" else (37, 100)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(V, d, generator=g) / d**0.5).to(DEVICE, DTYPE)
    x = torch.randn(1, d, generator=g).to(DEVICE, DTYPE)
    rows = []
    with ops.use_kernel("triton"):
        for K in ks:
            tag = f"head K={K:,}"
            idx = torch.randperm(V, generator=g)[:K].sort().values.to(DEVICE)
            count = torch.tensor([K], dtype=torch.int32, device=DEVICE)
            out = ops.head_compact(x, w, None, idx, count)
            ref = F.linear(x.float(), w[idx].float())
            err = rel_err(out, ref)
            c.within(f"{tag}: compact logits vs a float32 reference", err, HEAD_TOL)
            n = K - 7  # a device-side count below the buffer's capacity
            part = ops.head_compact(x, w, None, idx, torch.tensor([n], dtype=torch.int32,
                                                                    device=DEVICE))
            c.check(f"{tag}: -inf past a device-side count of {n:,}, same logits before it",
                    bool(torch.isneginf(part[..., n:]).all())
                    and rel_err(part[..., :n], ref[..., :n]) <= HEAD_TOL,
                    f"{int(torch.isneginf(part[..., n:]).sum())}/{K - n} tail entries -inf")
            full = ops.head_full(x, w, None, idx, count)
            inactive = torch.ones(V, dtype=torch.bool, device=DEVICE)
            inactive[idx] = False
            n_inf = int(torch.isneginf(full[..., inactive]).sum())
            c.check(f"{tag}: full logits -inf on every inactive id, the compact ones on the "
                    "active", n_inf == V - K and rel_err(full[..., idx], ref) <= HEAD_TOL,
                    f"{n_inf:,}/{V - K:,} inactive ids -inf")
            rows.append(dict(section="head", V=V, d=d, K=K, rel_err=err))
        idx = torch.randperm(V, generator=g)[:ks[0]].to(DEVICE)
        count = torch.tensor([ks[0]], dtype=torch.int32, device=DEVICE)
        for M in (1, 20):  # the one-row path and the tl.dot path
            x32 = torch.randn(M, d, generator=g).to(DEVICE)
            out = ops.head_compact(x32, w.float(), None, idx, count)
            exact = x32.double() @ w[idx].double().T
            c.within(f"head fp32 M={M}: logits vs a float64 reference (TF32 would miss)",
                     rel_err(out.double(), exact), 1e-5)
    return rows


def roofline_section(c: Checks) -> list[dict]:
    return kernel_roofline.section(c, DEVICE, DTYPE, HEAD_TOL)


def state_section(c: Checks) -> list[dict]:
    """Cost of one step's state update (admit, which also counts the learned core, then the head's
    read of the active ids), with no host sync, and every received id active after it."""
    from trimpass.config import TrimConfig
    from trimpass.dynamic.state import ActiveState
    V = EAGLE.V if DEVICE == "cuda" else 1_031
    cap, learn = (4096, 1024) if DEVICE == "cuda" else (64, 16)
    rows = []
    for B, S in ((1, 1), (1, 8), (8, 1)):
        tag = f"state B={B} S={S}"
        st = ActiveState(TrimConfig(capacity=cap, learn_core=learn).settings)
        st.build(V, DEVICE)
        ids = torch.randint(0, V, (B, S), device=DEVICE)

        def step(st=st, ids=ids, B=B):  # the two ops the pass inserts around a token lookup
            token = torch.ops.trimpass.admit(st.token, ids, None, st.serial)
            return torch.ops.trimpass.active(token, B, cap, st.serial)

        try:
            with host_sync_guard():
                for _ in range(3):
                    idx, count = step()
            c.check(f"{tag}: no host sync in the update", True)
        except ImportError as e:
            c.skip(f"{tag}: no host sync in the update", f"guard unavailable ({e})")
            idx, count = step()
        except RuntimeError as e:  # HostSyncError, or CUDA's sync debug mode
            c.check(f"{tag}: no host sync in the update", False, f"{type(e).__name__}: {e}")
            idx, count = step()
        missing = sum(int((~torch.isin(ids[b], idx[b, :int(count[b])])).sum()) for b in range(B))
        c.check(f"{tag}: every received id is active in its row", missing == 0,
                f"{missing} of {B * S} ids missing")
        ms = bench_ms(step)
        graph_us = measure.graph_ms(step) * 1e3 if DEVICE == "cuda" else float("nan")
        if DEVICE == "cuda":
            c.check(f"{tag}: the update costs <= 20 us, captured or eager",
                    min(graph_us, ms * 1e3) <= 20, f"{graph_us:.1f} us captured, "
                    f"{ms * 1e3:.1f} us eager")
        rows.append(dict(section="state", B=B, S=S, V=V, us=ms * 1e3, graph_us=graph_us))
    print(f"\n## dynamic-vocabulary state update (admit + active), capacity {cap}")
    print("| B | ids per row | us per step, eager | in a CUDA graph |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['S']} | {r['us']:.1f} | {r['graph_us']:.1f} |")
    print()
    return rows


def step_sections() -> dict:
    """One section per drafter shape, so an exception in one leaves the other's figures."""
    import gpu_step  # beside this script

    def one(shape):
        return lambda c: gpu_step.step_section(c, DEVICE, DTYPE, STEP_TOL, bench_ms, rel_err,
                                               shape)

    return {f"step {shape}": one(shape) for shape in gpu_step.shape_names()}


def host_section(c: Checks) -> list[dict]:
    import gpu_step
    return gpu_step.host_section(c, DEVICE, DTYPE)


def fused_section(c: Checks) -> list[dict]:
    import gpu_fused  # beside this script
    return gpu_fused.section(c, DEVICE, DTYPE)


def write(results: dict) -> None:
    """The JSON so far, rewritten after each section: a run cut at its time limit keeps what it
    measured and where its time went."""
    if not ARGS.out:
        return
    os.makedirs(ARGS.out, exist_ok=True)
    path = os.path.join(ARGS.out, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU smoke version")
        return 2
    import triton
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"# trimpass gpu_check on {name}; torch {torch.__version__}, triton "
          f"{triton.__version__}, Python {sys.version.split()[0]}; trimpass from "
          f"{os.path.dirname(trimpass.__file__)}", flush=True)
    t0 = time.time()
    c = Checks()
    problems = self_check()
    c.check("self-check: planted failures are counted and fail the run", not problems,
            "; ".join(problems) or "3 planted failures counted, exit code 1")
    if ARGS.inject_failure:
        c.check("injected failure", False, "planted by --inject-failure")
    sections = {"head": head_section, "roofline": roofline_section, "state": state_section,
                "host": host_section, **step_sections(), "fused": fused_section}
    results = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
               "trimpass": os.path.dirname(trimpass.__file__), "section_seconds": {}}
    for key, fn in sections.items():
        print(f"=== section {key}", flush=True)
        start = time.time()
        results[key] = c.section(key, fn)
        results["section_seconds"][key] = round(time.time() - start, 1)
        results["seconds"], results["checks"] = time.time() - t0, [asdict(r) for r in c.rows]
        print(f"=== section {key}: {results['section_seconds'][key]:.1f} s", flush=True)
        write(results)
    print(f"total {results['seconds']:.0f} s; per section: " + ", ".join(
        f"{k} {v:.0f} s" for k, v in results["section_seconds"].items()))
    for r in c.rows:
        if r.status == "FAIL":
            print(f"FAILED {r.name}: {r.detail}")
    print(c.summary())
    return c.exit_code()


if __name__ == "__main__":
    sys.exit(main())
