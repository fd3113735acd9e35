"""Test set-up: the Triton interpreter on (before triton is imported), fixed seeds, helpers."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def assert_close_rel(actual, expected, dtype):
    """Finite entries agree to the dtype's tolerance relative to the largest magnitude; -inf
    entries agree exactly."""
    a, e = actual.double(), expected.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(e)), "-inf pattern differs"
    fin = torch.isfinite(e)
    assert torch.isfinite(a[fin]).all(), "non-finite value where a finite one was expected"
    if fin.any():
        err = (a[fin] - e[fin]).abs().max() / e[fin].abs().max().clamp_min(1e-6)
        assert err < TOL[dtype], f"relative error {float(err):.3g} over {TOL[dtype]} for {dtype}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo():
    """Each test module starts with Dynamo's caches empty: Hugging Face models share their
    forward's decorator code object, and Dynamo keeps at most ``recompile_limit`` graphs per code
    object in a process, so the modules a worker ran before (an order pytest-xdist picks) would
    otherwise decide whether a later module's drafter compiles at all."""
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    """Modules with a test marked ``slow`` (the real Gemma) first, in their order: run in
    parallel (``tests/run``: ``-n 2 --dist loadfile``), the longest start at once instead of
    last."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)
