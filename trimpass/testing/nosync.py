"""``no_host_sync()``: fail a test when code under it would make the host wait for the device.

A drafter step must never sync with the host: one ``.item()`` per step stalls the CUDA stream and
breaks CUDA-graph capture. On the CPU machines the tests run on there is no stream to stall, so
this ``TorchDispatchMode`` looks at the ops instead and raises :class:`HostSyncError` on

* ``aten._local_scalar_dense`` / ``aten.item`` (what ``.item()``, ``int(t)``, ``float(t)``,
  ``bool(t)``, ``if t:``, f-string formatting of a tensor dispatch), and ``aten.equal`` /
  ``aten.allclose`` (they return a Python bool);
* ops whose output shape depends on the data (``nonzero``, ``masked_select``, the ``unique``
  family, ``bincount``, ``repeat_interleave`` without ``output_size``, and indexing or index
  assignment with a boolean mask, which runs ``nonzero`` inside);
* copies from a non-CPU device to the CPU (``.cpu()``, ``.to("cpu")``, ``cpu_t.copy_(dev_t)``).

It checks on every device (the CPU run stands in for the GPU one) and also looks inside custom
ops (``torch.ops.trimpass.*`` or any other non-aten namespace): they are re-dispatched to their
device kernel with the mode still active, so an ``.item()`` hidden in an op's Python kernel (or a
Triton launcher's host code, under ``TRITON_INTERPRET=1``) is caught too. A violation that the
code under test catches and swallows is raised again when the ``with`` block exits.

Not seen: ``Tensor.tolist()`` / ``.numpy()`` on a CPU tensor read memory without dispatching (on
a GPU tensor they first copy to the CPU, which is caught), and code compiled by ``torch.compile``
runs outside the mode.

    with no_host_sync():
        torch.ops.trimpass.admit(...)
    with no_host_sync(allow={"aten.equal"}):  # let named ops through
        ...
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SCALAR_READS = {aten._local_scalar_dense.default: "reads a tensor's value on the host",
                aten.item.default: "reads a tensor's value on the host",
                aten.equal.default: "returns a Python bool", aten.allclose.default:
                "returns a Python bool"}
DATA_DEPENDENT = {aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                  aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount}
MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_,
                 aten._unsafe_index, aten._unsafe_index_put}


class HostSyncError(RuntimeError):
    """An op under :func:`no_host_sync` would make the host wait for the device."""


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _why(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` syncs with the host, or None when it does not."""
    if func in SCALAR_READS:
        return SCALAR_READS[func]
    packet = func.overloadpacket
    if packet in DATA_DEPENDENT:
        return "its output shape depends on the data (a nonzero inside)"
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None and \
            func is aten.repeat_interleave.Tensor:
        return "repeat_interleave without output_size: its output shape depends on the data"
    if packet in MASK_INDEXING and len(args) > 1:
        indices = args[1] if isinstance(args[1], (list, tuple)) else ()
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices):
            return "indexing with a boolean mask (a nonzero inside)"
    if func is aten._to_copy.default and _on_device(args[0]):
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cpu":
            return f"copies a {args[0].device} tensor to the CPU"
    if func is aten.copy_.default and _on_device(args[1]) and not _on_device(args[0]) \
            and isinstance(args[0], torch.Tensor):
        return f"copies a {args[1].device} tensor into a CPU tensor"
    return None


class _NoHostSync(TorchDispatchMode):
    def __init__(self, allow=()):
        super().__init__()
        self.allow = set(allow)
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}.{func.overloadpacket.__name__}"
        why = None if name in self.allow or str(func) in self.allow else _why(func, args, kwargs)
        if why is not None:
            msg = f"host sync under no_host_sync(): {func} {why}"
            self.violations.append(msg)
            raise HostSyncError(msg)
        if func.namespace not in ("aten", "prim", "prims"):
            # a custom op: run its device kernel with this mode still on, so the ops inside are
            # checked too (a plain call would run them with the mode popped)
            dev = next((a.device for a in (*args, *kwargs.values())
                        if isinstance(a, torch.Tensor)), None)
            if dev is not None:
                key = getattr(torch._C.DispatchKey, torch._C._dispatch_key_for_device(dev.type))
                with self:
                    return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
        return func(*args, **kwargs)


class no_host_sync:  # noqa: N801 - used like a function: ``with no_host_sync():``
    """Context manager: raise :class:`HostSyncError` on any op that would sync with the host.

    ``allow``: op names to let through, as ``"aten.equal"`` (every overload) or
    ``"aten.equal.default"``. ``violations`` lists what was caught, after the block too.
    """

    def __init__(self, allow=()):
        self._mode = _NoHostSync(allow)

    @property
    def violations(self) -> list[str]:
        return self._mode.violations

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._mode.__exit__(exc_type, exc, tb)
        if exc_type is None and self.violations:
            raise HostSyncError(f"{len(self.violations)} host sync(s) caught and swallowed "
                                f"inside no_host_sync(); the first: {self.violations[0]}")
        return False


READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")
# where a read is not the loop's: an op's own kernel running its Python (on a GPU its device kernel
# runs, checked by no_host_sync), and the controller's arithmetic over the host data it is handed
HOST_SIDE = ("torch/_ops.py", "trimpass/spec/control/")


class host_reads:  # noqa: N801 - used like a function: ``with host_reads() as r:``
    """Context manager: count the reads from the device to the host under it (``count``; ``log``
    names each): every ``Tensor`` method in :data:`READS` (``.item()``, ``int(t)``, ``float(t)``,
    ``bool(t)``, a tensor used as an index, ``tolist()``, ``numpy()``), wrapped on the class for
    the block, so the CPU run counts what a GPU run would wait for. A read whose stack passes
    through ``skip`` (default :data:`HOST_SIDE`) is not counted. Unlike :class:`no_host_sync` it
    sets no dispatch mode, which ``torch.compile`` refuses to run under: compiled graphs run as
    they would (none of them reads the host; ``fullgraph=True`` refuses a graph that does)."""

    def __init__(self, skip=HOST_SIDE):
        self.log: list[str] = []
        self.skip = tuple(skip)
        self._kept: dict = {}

    @property
    def count(self) -> int:
        return len(self.log)

    def _seen(self, name: str) -> None:
        import traceback
        frames = traceback.extract_stack()[:-2]
        if not any(s in f.filename for f in frames for s in self.skip):
            self.log.append(f"Tensor.{name} at {frames[-1].filename}:{frames[-1].lineno}")

    def __enter__(self):
        for name in READS:
            original = self._kept[name] = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self._seen(_name)
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._kept.items():
            setattr(torch.Tensor, name, original)
        return False
