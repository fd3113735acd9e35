"""``trimpass.testing.nosync.no_host_sync``: it catches each kind of host sync and lets clean code
through."""
import contextlib

import pytest
import torch

from trimpass.testing.nosync import HostSyncError, no_host_sync

_lib = torch.library.Library("nosync_test", "DEF")
_lib.define("shift_by_sum(Tensor x) -> Tensor")
_lib.define("shift_by_max(Tensor x) -> Tensor")


def _shift_by_sum(x):  # a custom op whose Python kernel hides an .item()
    return x + x.sum().item()


def _shift_by_max(x):  # the same op kept on the device
    return x + x.max()


_lib.impl("shift_by_sum", _shift_by_sum, "CompositeExplicitAutograd")
_lib.impl("shift_by_max", _shift_by_max, "CompositeExplicitAutograd")


@pytest.mark.parametrize("sync", [
    lambda t: t.sum().item(),
    lambda t: int(t[0]),
    lambda t: float(t.max()),
    lambda t: 1 if t.sum() > 0 else 0,
    lambda t: f"{t.sum():.3f}",
], ids=["item", "int", "float", "if", "format"])
def test_scalar_reads_raise(sync):
    t = torch.arange(4.0)
    with pytest.raises(HostSyncError, match=r"_local_scalar_dense.* reads a tensor's value"), \
            no_host_sync():
        sync(t)


def test_bool_of_a_tensor_raises():
    t = torch.tensor([1.0, 2.0])
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), no_host_sync():
        bool(t.any())
    with pytest.raises(HostSyncError, match="returns a Python bool"), no_host_sync():
        torch.equal(t, t)


@pytest.mark.parametrize("op, name", [
    (lambda t: t.nonzero(), "nonzero"),
    (lambda t: torch.where(t > 1), "nonzero"),
    (lambda t: t[t > 1], "boolean mask"),
    (lambda t: t.masked_select(t > 1), "masked_select"),
    (lambda t: torch.unique(t), "unique"),
    (lambda t: torch.bincount(t.long()), "bincount"),
    (lambda t: torch.repeat_interleave(t.long()), "output_size"),
    (lambda t: t.clone().index_put_((t > 1,), torch.tensor(0.0)), "boolean mask"),
], ids=["nonzero", "where", "mask-index", "masked_select", "unique", "bincount",
        "repeat_interleave", "mask-assign"])
def test_data_dependent_shapes_raise(op, name):
    t = torch.tensor([0.0, 2.0, 3.0, 2.0])
    op(t)  # fine outside the mode
    with pytest.raises(HostSyncError, match=name), no_host_sync():
        op(t)


def test_device_to_cpu_copies_raise():
    dev = torch.empty(3, device="meta")  # any non-CPU device; the copy is refused before it runs
    with pytest.raises(HostSyncError, match="copies a meta tensor to the CPU"), no_host_sync():
        dev.cpu()
    with pytest.raises(HostSyncError, match="copies a meta tensor to the CPU"), no_host_sync():
        dev.to("cpu", torch.float64)
    with pytest.raises(HostSyncError, match="into a CPU tensor"), no_host_sync():
        torch.zeros(3).copy_(dev)


def test_clean_code_passes_and_computes_the_same():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, generator=g), torch.randn(32, 8, generator=g)
    idx, count = torch.tensor([3, 9, 17, 30]), torch.tensor([3])

    def step():
        logits = x @ w[idx].T
        live = torch.arange(idx.numel()) < count  # device-side count, no host read
        logits = logits.masked_fill(~live, float("-inf"))
        full = torch.full((2, 32), float("-inf")).scatter(1, idx.expand(2, -1), logits)
        top = full.topk(2, dim=-1)
        fixed = torch.nonzero_static(live, size=4, fill_value=-1)
        torch._assert_async(count > 0)
        return full.softmax(-1), top.indices, full.argmax(-1), fixed, idx.to("meta")

    ref = step()
    with no_host_sync() as guard:
        out = step()
        custom = torch.ops.nosync_test.shift_by_max(x)
    assert guard.violations == []
    for a, b in zip(ref[:4], out[:4], strict=True):
        assert torch.equal(a, b)
    assert out[4].device.type == "meta"  # host-to-device copies are allowed
    assert torch.equal(custom, x + x.max())


def test_an_item_inside_a_custom_op_is_caught():
    x = torch.arange(3.0)
    assert torch.equal(torch.ops.nosync_test.shift_by_sum(x), x + 3)
    with pytest.raises(HostSyncError, match="reads a tensor's value"), no_host_sync():
        torch.ops.nosync_test.shift_by_sum(x)


def test_a_swallowed_violation_is_raised_at_exit():
    swallowed = r"1 host sync\(s\) caught and swallowed"
    with pytest.raises(HostSyncError, match=swallowed), no_host_sync(), \
            contextlib.suppress(HostSyncError):  # code under test that swallows errors
        torch.ones(2).sum().item()
    assert torch.ones(2).sum().item() == 2.0  # the mode is gone after the block


def test_allow_lets_a_named_op_through():
    t = torch.ones(3)
    with no_host_sync(allow={"aten.equal"}) as guard:
        assert torch.equal(t, t)
    assert guard.violations == []
    with pytest.raises(HostSyncError, match="nonzero"), no_host_sync(allow={"aten.equal"}):
        t.nonzero()  # only the named op
