"""Measurements every strategy reports, with the definitions all notebooks share.

Memory is counted from the tensors actually held, so it works on the CPU where there is no
allocator to ask: a category's bytes are the sum of ``nbytes`` over the distinct storages its
tensors live in (a view or a tied weight is counted once). On CUDA the allocator's peak is
reported beside it; on the CPU ``AllocatorPeak`` reads the CPU allocator's own record of a block
through PyTorch's profiler.
"""
from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from collections.abc import Iterable
from contextlib import contextmanager

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "comm_buffers")


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            seen.setdefault(_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def model_state_memory(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None
                       ) -> dict[str, int]:
    params = list(params)
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(optimizer_tensors(optimizer)) if optimizer else 0,
    }


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of tensors autograd saves for backward ("activations").

    A ``saved_tensors_hooks`` pair wraps each saved tensor; when autograd frees the saved
    value (after its backward ran, or when the graph is dropped) the wrapper dies and its
    storage is released from the count. Parameters that autograd saves (a weight kept for the
    input-gradient matmul) are excluded: they are counted under "parameters". ``current`` is
    what is held now, ``peak`` the most held at once since ``reset_peak``.

    With activation recomputation (``dlab.models.recompute``) the meter counts what is kept:
    a recomputed block's input, or the attention core's q, k, v, saved by the checkpoint under
    these same hooks. The strategies track the forward only, so their peak is the end of the
    forward, what recomputation keeps. The recomputed activations exist again, transiently,
    during their region's backward (one region at a time); they are counted only when the
    backward also runs inside ``track()``, and then the peak can be reached in backward, above
    the forward's (``dlab.theory.activations``: ``backward_peak``).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.exclude = {_key(t) for t in exclude}
        self.refs: dict[tuple, int] = {}
        self.current = self.peak = 0

    def skip(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is not an activation; strategies that gather parameters on the fly
        extend this so a gathered weight counts under "parameters"."""
        return _key(t) in self.exclude or not t.numel()

    def hold(self, t: torch.Tensor):
        """Count ``t`` as held until the returned handle is dropped (the pack hook; pipeline
        stages also call it for the activations they keep between forward and backward)."""
        if self.skip(t):
            return t
        key = _key(t)
        if key not in self.refs:
            self.refs[key] = 0
            self.current += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.current)
        self.refs[key] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, key, t.untyped_storage().nbytes())
        return saved

    def _release(self, key: tuple, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.current -= nbytes

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def reset_peak(self) -> None:
        self.peak = self.current

    @contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self.hold, self._unpack):
            yield self


class Stopwatch:
    """Wall time of a block; on CUDA it synchronises first so queued kernels are counted."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


class StoragePeak:
    """The most bytes ``tensors()`` held at once while the block ran, read from their storages
    (each once) after every operator, forward and backward: a figure counted, not booked, for
    buffers that are allocated and freed inside a step (ZeRO-3's gathered units)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.peak = 0

    def sample(self) -> None:
        self.peak = max(self.peak, storage_bytes(self.tensors()))

    @contextmanager
    def track(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _EveryOp(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter.sample()
                return out

        self.sample()
        with _EveryOp():
            yield self


class Transient:
    """Buffers that live only during a step, counted from their storages rather than booked
    (the ``comm_buffers`` of the ZeRO strategies and of ``nd``).

    Each buffer is registered once it is allocated (``held(kind, tensor)``; kinds: ``unit`` a
    gathered unit, ``reduce`` a flattened gradient being reduced, ``send`` an all-gather's send
    copy, ``master_grad`` the optimizer's fp32 gradient copy, ``recv`` a pipeline receive
    posted) and only weakly referenced, so it counts exactly as long as its storage exists and
    has bytes, whoever keeps it. A buffer a collective used is returned with ``free`` (its
    storage resized to 0, as FSDP frees a gathered unit) as soon as the collective is waited
    for: Gloo's worker thread lets go of its own reference a moment after the wait returns, so
    a buffer left to its last reference would count or not by a race. A buffer that outlives
    its transfer as something else (a received activation handed to its stage) leaves the
    count with ``drop``, its storage untouched. The bytes alive are read at every
    registration; they grow only when a buffer is allocated, so the largest read is the peak
    since ``reset_peak``, in all and per kind (each storage counted once)."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[str, weakref.ref]] = {}
        self.peak = 0
        self.kind_peak: dict[str, int] = {}

    def held(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        self.buffers[id(tensor)] = (kind, weakref.ref(tensor))
        self.sample()
        return tensor

    @staticmethod
    def free(tensor: torch.Tensor) -> None:
        tensor.untyped_storage().resize_(0)

    def drop(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``, which lives on as something other than a buffer."""
        self.buffers.pop(id(tensor), None)

    def alive(self) -> dict[str, list[torch.Tensor]]:
        by_kind: dict[str, list[torch.Tensor]] = {}
        for key, (kind, ref) in list(self.buffers.items()):
            t = ref()
            if t is None:
                del self.buffers[key]
            else:
                by_kind.setdefault(kind, []).append(t)
        return by_kind

    def sample(self) -> None:
        by_kind = self.alive()
        self.peak = max(self.peak, storage_bytes(t for ts in by_kind.values() for t in ts))
        for kind, ts in by_kind.items():
            self.kind_peak[kind] = max(self.kind_peak.get(kind, 0), storage_bytes(ts))

    def reset_peak(self) -> None:
        self.peak, self.kind_peak = 0, {}
        self.sample()


@contextmanager
def _quiet_stderr():
    """Point the process's file descriptor 2 at /dev/null for the block (C++ libraries write
    there directly, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class AllocatorPeak:
    """The CPU allocator's own record of a block: the most bytes held at once by the memory
    blocks it allocated during the block (``peak``), the bytes of those still held at the end
    (``held``), how many it allocated (``allocations``), and the bytes it freed during the block
    of memory allocated before it (``freed_before``, not subtracted from the others).

    The CPU has no allocator statistic to ask (CUDA has ``torch.cuda.max_memory_allocated``).
    With ``profile_memory=True`` PyTorch's profiler has the CPU allocator report every
    allocation and every free (its address, size and time); ``peak`` is the largest running sum
    of the block's own allocations in time order, each leaving the sum when its address is
    freed. It sees everything the block allocates through PyTorch's CPU allocator, saved for
    backward or not, so also the transients no saved-tensor count holds (a matmul's output that
    the next operator consumes, the logits the loss reads); it does not see memory that
    libraries allocate outside it. Where nothing older is freed inside the block, ``peak`` is
    what, on a GPU, ``torch.cuda.max_memory_allocated`` minus the start gives (there each block
    is rounded up to 512 bytes). The records are read
    from the profiler's event tree (``experimental_event_tree``, an interface PyTorch marks
    experimental). The free of a block allocated before any profiling has no recorded size (the
    profiler warns on stderr); Python's garbage collector runs before the block and is paused
    during it, so that it does not free older objects inside the window.

    The profiler's engine (Kineto) writes a line with the time of day to the process's stderr
    when it starts and when it stops; those two calls run with stderr pointed at /dev/null, so
    that a notebook cell that measures prints the same on every run. The block itself runs with
    stderr as it is."""

    def __init__(self) -> None:
        self.peak = self.held = self.allocations = self.freed_before = 0

    @contextmanager
    def track(self):
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with _quiet_stderr():
                prof.start()
            try:
                yield self
            finally:
                with _quiet_stderr():
                    prof.stop()
        finally:
            if collecting:
                gc.enable()
        self._read(prof.profiler.kineto_results.experimental_event_tree())

    def _read(self, roots) -> None:
        # private to torch's profiler: imported here, so that a torch that moves it breaks this
        # meter alone and not every module that imports dlab.core.metrics
        from torch._C._profiler import _EventType

        events, stack = [], list(roots)
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                f = node.extra_fields
                events.append((node.start_time_ns, f.ptr, f.alloc_size))
        live: dict[int, int] = {}
        running = peak = allocations = freed_before = 0
        for _, ptr, size in sorted(events, key=lambda e: e[0]):
            if size > 0:
                live[ptr] = size
                running += size
                allocations += 1
                peak = max(peak, running)
            elif ptr in live:
                running -= live.pop(ptr)
            else:
                freed_before -= size
        self.peak, self.held = peak, running
        self.allocations, self.freed_before = allocations, freed_before
