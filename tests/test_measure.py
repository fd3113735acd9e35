"""trimpass.measure: the timers, the call timer that wraps a module in place and leaves it as found,
and the per-device cache of measured costs."""
import itertools
from collections import Counter

import pytest
import torch

from trimpass import measure


def test_median_and_interleaved_timers_time_the_work():
    x = torch.randn(64, 64)
    ms = measure.median_ms(lambda: x @ x, "cpu", min_time_s=0.02)
    assert 0 < ms < 1_000
    calls = []
    out = measure.interleaved_ms({"a": lambda: calls.append("a"), "b": lambda: x @ x}, rounds=3,
                                 device="cpu", calls=4)
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert len(calls) == 2 + 3 * 4  # two warm-up calls, then rounds x calls
    measure.sync("cpu")
    measure.sync()


def test_interleaved_order_gives_each_variant_every_predecessor_about_equally():
    # What runs before a variant changes its time (a large weight streamed just before evicts the
    # caches its successor needs), so no variant may follow one other variant most of the time.
    ran = []
    names = "abc"
    measure.interleaved_ms({n: (lambda n=n: ran.append(n)) for n in names}, rounds=600,
                           device="cpu", calls=1)
    timed = ran[2 * len(names):]  # after the warm-up calls
    follows = Counter(itertools.pairwise(timed))
    pairs = [follows[p, v] for p in names for v in names if p != v]
    assert len(timed) == 600 * 3 and all(sorted(timed[i:i + 3]) == list(names)
                                         for i in range(0, len(timed), 3))
    assert max(pairs) / min(pairs) < 1.3, f"predecessor counts unbalanced: {follows}"


def test_faster_picks_the_one_with_the_better_best_time(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def costs(*steps):  # a callable whose successive calls take these times
        it = iter(steps)
        return lambda: clock.__setitem__(0, clock[0] + next(it))
    assert measure.faster(costs(50, 9, 2, 9), costs(0, 3, 3, 3))  # best 2 beats best 3
    assert not measure.faster(costs(0, 2, 5, 5), costs(50, 4, 1, 9))  # the first call untimed
    assert not measure.faster(costs(0, 3, 3, 3), costs(0, 3, 3, 3)), "a tie keeps the second"
    evictions = []

    def before():  # untimed: 5 before each call of the first, 0 before the second's
        evictions.append(len(evictions))
        clock[0] += 5 if len(evictions) % 2 else 0
    assert measure.faster(costs(0, 2, 2, 2), costs(0, 3, 3, 3), before=before)
    assert len(evictions) == 6, "before runs once before each timed call"
    assert measure.best_ms(costs(0.009, 0.002, 0.004)) == pytest.approx(2.0)  # ms, fastest call
    assert measure.best_ms(costs(0.007, 0.001), tries=1) == pytest.approx(7.0)


def test_stopwatch_times_each_call():
    sw = measure.Stopwatch()
    assert sw(lambda a, b=0: a + b, 1, b=2) == 3
    sw(sum, [1, 2])
    assert sw.calls == 2 and len(sw.ms) == 2 and sw.total_s >= 0 and sw.median_ms >= 0


def test_time_calls_counts_every_call_and_leaves_the_module_as_found():
    lin = torch.nn.Linear(4, 4)
    with measure.time_calls(lin) as sw:
        lin(torch.randn(2, 4))
        lin(torch.randn(2, 4))
        lin.forward(torch.randn(2, 4))  # not through __call__: not seen
    assert sw.calls == 2
    assert "_compiled_call_impl" not in lin.__dict__ and lin._compiled_call_impl is None

    lin.compile(backend="eager")
    compiled = lin._compiled_call_impl
    seen = []
    with measure.time_calls(lin, on_call=lambda: seen.append(1)) as sw:
        out = lin(torch.ones(1, 4))
    assert sw.calls == 1 and seen == [1] and lin._compiled_call_impl is compiled
    assert torch.allclose(out, lin.forward(torch.ones(1, 4)))


def test_cached_measures_once_per_device_torch_and_model_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIMPASS_CACHE", str(tmp_path))
    runs = []

    def compute():
        runs.append(1)
        return {"ms": 1.5 * len(runs)}

    assert measure.cached("head 1000x64", compute) == {"ms": 1.5}
    assert measure.cached("head 1000x64", compute) == {"ms": 1.5} and len(runs) == 1
    assert measure.cached("head 2000x64", compute) == {"ms": 3.0} and len(runs) == 2
    assert measure.cached("head 1000x64", compute, refresh=True) == {"ms": 4.5}
    assert measure.cached("head 1000x64", compute) == {"ms": 4.5} and len(runs) == 3
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")  # another torch: measured again
    assert measure.cached("head 1000x64", compute) == {"ms": 6.0} and len(runs) == 4
    assert "threads" in measure.device_name("cpu")
