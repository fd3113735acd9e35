"""Bad input to the kernels' launchers: each raises an error naming the argument (or triton's
version) before any launch. The kernels are replaced by tripwires, so a check that lets a bad call
through fails the test instead of launching."""
import pytest
import torch
import triton

from trimpass import kernels
from trimpass.kernels import trimmed_head as th
from trimpass.kernels import vocab_state as vs


class Tripwire:
    def __getitem__(self, grid):
        raise AssertionError("the kernel was launched")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(th, "_tuned_kernel", Tripwire())
    monkeypatch.setattr(th, "_trimmed_head_kernel", Tripwire())
    monkeypatch.setattr(vs, "_admit_kernel", Tripwire())


def _head(dtype=torch.float32, G=1, R=2, d=64, V=300, CAP=32):
    return dict(x=torch.randn(G, R, d).to(dtype), weight=torch.randn(V, d).to(dtype),
                idx=torch.randperm(V)[:CAP].reshape(1, CAP).repeat(G, 1),
                count=torch.full((G,), CAP, dtype=torch.int32))


def _bad_head_calls():
    def noncontiguous_weight(a):
        a["weight"] = torch.randn(a["x"].shape[-1], 300).T
    def float64(a):
        a["x"], a["weight"] = a["x"].double(), a["weight"].double()
    def int8_weight(a):
        a["weight"] = a["weight"].to(torch.int8)
    def narrow_out(a):  # more ids than the output's capacity
        a["out"] = torch.empty(1, 2, a["idx"].shape[1] - 1)
    def scatter_into_compact(a):
        a["out"], a["scatter"] = torch.empty(1, 2, a["idx"].shape[1]), True
    def strided_x(a):
        a["x"] = torch.randn(1, 2, 128)[..., ::2]
    def float_idx(a):
        a["idx"] = a["idx"].float()
    def two_counts(a):
        a["count"] = torch.full((2,), 5, dtype=torch.int32)
    def short_bias(a):
        a["bias"] = torch.zeros(299)
    def meta_count(a):
        a["count"] = a["count"].to("meta")
    return [("weight", noncontiguous_weight), ("x: dtype torch.float64", float64),
            ("weight and bias: dtype", int8_weight), ("out:", narrow_out),
            ("out:", scatter_into_compact), ("weight and x", strided_x), ("idx:", float_idx),
            ("count:", two_counts), ("bias:", short_bias), ("count: on meta", meta_count)]


@pytest.mark.parametrize("names,spoil", _bad_head_calls(), ids=lambda v: getattr(v, "__name__",
                                                                                 None))
def test_head_refuses_bad_input_before_launch(names, spoil, no_launch):
    args = _head()
    spoil(args)
    with pytest.raises((ValueError, TypeError), match=names.replace("(", r"\(")):
        th.trimmed_head(**args)


def test_head_refuses_a_cpu_tensor_outside_the_interpreter(monkeypatch, no_launch):
    monkeypatch.setattr(th, "INTERPRET", False)
    with pytest.raises(ValueError, match="x: on cpu; the Triton kernel runs on CUDA"):
        th.trimmed_head(**_head())


def test_a_good_call_reaches_the_launch(no_launch):
    """The control: the same inputs, unspoiled, pass every check and hit the tripwire."""
    with pytest.raises(AssertionError, match="launched"):
        th.trimmed_head(**_head())
    with pytest.raises(AssertionError, match="launched"):
        vs.admit(**_admit())


@pytest.mark.parametrize("version,ok", [("3.2.0", False), ("3.5.1", False), ("3.6.0", True),
                                        ("3.10.0", True), ("3.8.0+git1234", True), ("4.0", True)])
def test_triton_floor_compares_releases_numerically(version, ok):
    if ok:
        kernels.require_triton(version, interpret=False)
    else:
        with pytest.raises(RuntimeError, match=f"triton {version} is older than 3.6"):
            kernels.require_triton(version, interpret=False)


@pytest.mark.parametrize("version,numpy_version,ok", [
    ("3.6.0", "2.4.6", False), ("3.7.1", "2.5.0", False), ("3.6.0", "2.3.5", True),
    ("3.8.0", "2.4.6", True), ("3.10.0", "3.0.0", True)])
def test_the_interpreter_refuses_a_triton_that_cannot_run_with_its_numpy(version, numpy_version,
                                                                          ok):
    if ok:
        kernels.require_triton(version, numpy_version, interpret=True)
        return
    with pytest.raises(RuntimeError, match=f"triton {version} cannot run with numpy "
                                           f"{numpy_version}.*'triton>=3.8' or 'numpy<2.4'"):
        kernels.require_triton(version, numpy_version, interpret=True)
    kernels.require_triton(version, numpy_version, interpret=False)  # compiled: no interpreter


def test_old_triton_is_refused_before_launch(monkeypatch, no_launch):
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    with pytest.raises(RuntimeError, match=r"triton 3.2.0 is older than 3.6.*triton>=3.6"):
        th.trimmed_head(**_head())
    with pytest.raises(RuntimeError, match="triton 3.2.0 is older than 3.6"):
        vs.admit(**_admit())


def _admit(B=2, S=3, cap=16):
    idx, stamp = vs.new_pool(4, cap, "cpu")
    return dict(idx=idx, stamp=stamp, count=torch.zeros(4, dtype=torch.int32),
                clock=torch.ones(1, dtype=torch.long), rows=torch.arange(B),
                ids=torch.randint(0, 100, (B, S)), n_core=0)


@pytest.mark.parametrize("name,change", [
    ("ids: expected", dict(ids=torch.zeros(2, vs.MAX_S + 1, dtype=torch.long))),
    ("idx and stamp", dict(idx=torch.zeros(4, 17, dtype=torch.int32))),
    ("rows: expected one pool row per batch position", dict(rows=torch.arange(3))),
    ("clock: on meta", dict(clock=torch.ones(1, dtype=torch.long, device="meta"))),
])
def test_admit_refuses_bad_input_before_launch(name, change, no_launch):
    with pytest.raises(ValueError, match=name):
        vs.admit(**{**_admit(), **change})
