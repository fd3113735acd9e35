"""Timing on a device, in one place: waiting for the device, timing repeatable work, timing the
calls a loop makes, and keeping measured costs per device.

- :func:`sync` waits for work queued on a device (CUDA launches are asynchronous: time the work,
  not the launch); a no-op on CPU.
- :func:`median_ms` times a repeatable zero-argument callable: ``triton.testing.do_bench`` on CUDA,
  ``torch.utils.benchmark.Timer`` (blocked autorange, at the caller's thread count) elsewhere.
- :func:`interleaved_ms` times several variants side by side, in a fresh random order each round,
  and reports each one's median, for ratios on a shared, noisy machine.
- :func:`faster` picks the faster of two ways of doing the same work (best of a few calls each),
  with the caches warm or, after :func:`cache_evictor`'s callable, cold.
- :class:`Stopwatch` times calls that cannot be repeated (a drafter's step inside a loop), one by
  one; :func:`time_calls` routes every call of a module, compiled in place or not, through one.
- :func:`cached` keeps a JSON-able measurement once per (device name, torch version, model key).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import pathlib
import platform
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator

import torch


def _device(device) -> torch.device | None:
    if device is None:
        return None
    return device if isinstance(device, torch.device) else torch.device(device)


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on ``device``; with no device, on the current CUDA device if CUDA
    is in use. A no-op on CPU."""
    dev = _device(device)
    if dev is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable, *args, device: torch.device | str | None = None, **kwargs):
    """``(fn(*args, **kwargs), seconds)`` of one call, the device's work waited for before and
    after: the one synchronized timing; the stopwatch, the cost model and the engine glue use it."""
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return out, time.perf_counter() - t0


def median_s_within(fn: Callable[[], object], share_s: float,
                    device: torch.device | str | None = None, max_calls: int = 1000) -> float:
    """Median seconds of :func:`timed` calls of ``fn()`` repeated while ``share_s`` lasts (at least
    one call, at most ``max_calls``): for work too slow for :func:`median_ms`'s repetitions."""
    start, samples = time.perf_counter(), []
    while not samples or (time.perf_counter() - start + samples[-1] <= share_s
                          and len(samples) < max_calls):
        samples.append(timed(fn, device=device)[1])
    return statistics.median(samples)


def median_ms(fn: Callable[[], object], device: torch.device | str = "cpu", *,
              min_time_s: float = 0.2) -> float:
    """Median ms of one call of ``fn()`` (warm-up included, device work waited for).

    CUDA: ``triton.testing.do_bench`` (median, ``min_time_s`` of repetitions). Elsewhere:
    ``torch.utils.benchmark.Timer.blocked_autorange`` at the current thread count (the Timer's
    default of one thread would time a different machine), at least ``min_time_s`` of calls.
    """
    dev = _device(device)
    if dev.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=max(1, round(min_time_s * 1e3)),
                                             return_mode="median"))
    from torch.utils.benchmark import Timer
    fn()  # warm-up: caches, allocator, lazy compilation
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_time_s).median * 1e3


def graph_ms(fn: Callable[[], object], *, calls: int = 20, replays: int = 9,
             flush_bytes: int = 256 << 20) -> float:
    """Ms of one call of ``fn()`` replayed in a CUDA graph with the L2 cache flushed before it:
    what a kernel costs inside a captured decode step, without the host's launch cost (which
    :func:`median_ms` includes: its events bracket the launch too). ``calls`` (flush, call) pairs
    are captured in one graph and ``calls`` flushes alone in another; the two are replayed in
    turn ``replays`` times, and the difference of their medians is divided by ``calls``."""
    fn()  # compiled and autotuned before the capture
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(3):
            flush.zero_()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    both, alone = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(both):
        for _ in range(calls):
            flush.zero_()
            fn()
    with torch.cuda.graph(alone):
        for _ in range(calls):
            flush.zero_()
    times: dict = {both: [], alone: []}
    for i in range(replays + 1):
        for g in (both, alone):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            if i:  # the first replay of each warms up
                times[g].append(start.elapsed_time(end))
    return max(0.0, statistics.median(times[both]) - statistics.median(times[alone])) / calls


def interleaved_ms(fns: dict[str, Callable[[], object]], rounds: int,
                   device: torch.device | str = "cpu", calls: int = 20,
                   seed: int = 0) -> dict[str, float]:
    """Median over ``rounds`` of the mean ms per call of each zero-argument callable.

    Each round runs every variant for ``calls`` back-to-back calls (as a drafter calls its head
    step after step), in a fresh random order (seeded), so each variant follows each other one
    about equally often. A variant's time depends on what ran before it: one that streams a large
    weight evicts the caches its successor needs. A rotated order keeps the cyclic order, so one
    variant would follow that one in nearly every round and pay for it alone.
    """
    dev = _device(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: autotuning, caches, allocator
        fn()
        fn()
    sync(dev)
    order = random.Random(seed)
    for _ in range(rounds):
        for name in order.sample(list(fns), len(fns)):
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(dev)
            times[name].append((time.perf_counter() - t0) * 1e3 / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def best_ms(fn: Callable[[], object], tries: int = 3) -> float:
    """The fastest of ``tries`` calls of ``fn()`` in ms, on the host's clock: a cost whose first
    calls run slow (a compiled graph's), taken once."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def faster(a: Callable[[], object], b: Callable[[], object], tries: int = 3,
           before: Callable[[], object] | None = None) -> bool:
    """Whether ``a()`` beats ``b()``, each timed ``tries`` times in alternation after one untimed
    call (best of each): for a one-off choice between two ways of doing the same work, on the
    host's clock. ``before`` (untimed) runs before each timed call, e.g. :func:`cache_evictor`'s
    callable to time the work as it runs inside a model step."""
    a()
    b()
    best = [float("inf"), float("inf")]
    for _ in range(tries):
        for i, fn in enumerate((a, b)):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] < best[1]


def cache_evictor(nbytes: int | None = None) -> Callable[[], None]:
    """A callable that pushes the CPU's data out of its caches by writing ``nbytes`` (default:
    twice the last-level cache this host reports, at least 64 MB). Inside a drafter's step the
    layers' weights evict the head's operands between two calls, so a choice made on warm caches
    would be made for a regime the head never runs in."""
    if nbytes is None:
        nbytes = max(2 * _last_level_cache_bytes(), 64 << 20)
    buf = _evictor_buffer(nbytes)
    return lambda: buf.fill_(1.0)


@functools.lru_cache(maxsize=2)  # one allocation per size, not one per decision
def _evictor_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, dtype=torch.float32)


@functools.cache  # the host's caches do not change while it runs
def _last_level_cache_bytes() -> int:
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = pathlib.Path(path).read_text().strip().upper()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)


class Stopwatch:
    """Wall ms of each call made through it, device work waited for before and after: for work
    that cannot be repeated at will (a drafter's or a target's step inside a loop)."""

    def __init__(self, device: torch.device | str | None = None, ms: list | None = None):
        self.device = _device(device)
        self.ms: list[float] = [] if ms is None else ms

    def __call__(self, fn, *args, **kwargs):
        out, seconds = timed(fn, *args, device=self.device, **kwargs)
        self.ms.append(seconds * 1e3)
        return out

    @property
    def calls(self) -> int:
        return len(self.ms)

    @property
    def total_s(self) -> float:
        return sum(self.ms) / 1e3

    @property
    def median_ms(self) -> float:  # robust to the first (compiling) calls
        return statistics.median(self.ms) if self.ms else float("nan")


@contextlib.contextmanager
def time_calls(module: torch.nn.Module, watch: Stopwatch | None = None,
               on_call: Callable[[], object] | None = None) -> Iterator[Stopwatch]:
    """Time (and count) every ``module(...)`` call made inside the block, whoever makes it.

    The call is wrapped where ``nn.Module.__call__`` dispatches (``_compiled_call_impl``), so a
    module compiled in place (``trimpass.trim``, ``module.compile``) is timed running its compiled
    forward, and loops that call the module (Hugging Face ``generate``) need no change. Calls
    through other entry points (``module.forward(...)``) are not seen. ``on_call()`` runs after
    each call, outside the timing.
    """
    watch = Stopwatch() if watch is None else watch
    had = "_compiled_call_impl" in module.__dict__
    before = module.__dict__.get("_compiled_call_impl")
    inner = before if before is not None else module._call_impl

    def call(*args, **kwargs):
        out = watch(inner, *args, **kwargs)
        if on_call is not None:
            on_call()
        return out

    module._compiled_call_impl = call
    try:
        yield watch
    finally:  # exactly as found: an uncompiled module stays uncompiled
        if had:
            module._compiled_call_impl = before
        else:
            del module._compiled_call_impl


def device_name(device: torch.device | str = "cpu") -> str:
    """What a measurement on ``device`` depends on: the GPU's name, or the CPU model and the
    thread count torch uses."""
    dev = _device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f
                    if line.startswith("model name")), cpu)
    return f"{dev.type}: {cpu} x{torch.get_num_threads()} threads"


def cached(model_key: str, compute: Callable[[], dict], device: torch.device | str = "cpu", *,
           refresh: bool = False) -> dict:
    """``compute()`` (a JSON-able dict) measured once per device name, torch version and
    ``model_key`` (what the caller timed: an op and its shapes), then read back from
    ``<cache_dir>/measure/``. ``refresh=True`` measures again and overwrites."""
    from trimpass.cache import cache_dir
    key = {"device": device_name(device), "torch": torch.__version__, "model": model_key}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_key)[:80]
    path = os.path.join(cache_dir(), "measure", f"{slug}-{digest}.json")
    if not refresh and os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        if stored.get("key") == key:
            return stored["value"]
    value = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w") as f:
        json.dump({"key": key, "value": value}, f)
    os.replace(tmp, path)  # concurrent writers: last one wins, never a torn file
    return value


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
