"""Copies between a GPU and host memory, made the way the CUDA path needs them.

A copy from a GPU into ordinary (pageable) host memory blocks the host until it lands and goes
through a staging buffer of the driver's; into page-locked (*pinned*) memory it runs by DMA at
the link's full rate and, with ``non_blocking=True``, is only enqueued on the current stream,
so many copies can be issued before one wait (PyTorch's "pinned memory" notes; NVIDIA's CUDA
C++ Best Practices Guide, "Pinned Memory"). PyTorch caches pinned blocks (its host caching
allocator), so a buffer taken per step is not a ``cudaHostAlloc`` per step.

The rule this module keeps: a device-to-host copy made with ``to_host`` may still be in flight
until ``host_copies_done(device)`` returns, and nothing on the host may read it before. A
host-to-device copy from pinned memory needs no wait of the host: later kernels on the same
stream are ordered after it. On the CPU every function here is a plain copy (or nothing),
which is how CI runs them.
"""
from __future__ import annotations

import torch


def to_host(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``tensor`` (cast to ``dtype``), never aliasing it: pinned and enqueued
    without blocking when ``tensor`` is on a GPU (call ``host_copies_done`` before reading
    it), a plain copy on the CPU."""
    dtype = dtype or tensor.dtype
    if tensor.device.type != "cuda":
        return tensor.to("cpu", dtype, copy=True)
    out = torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out


def pinned(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on the host in pinned memory when its partner ``device`` is a GPU (so copies
    to and from it can overlap), else as it is."""
    tensor = tensor.to("cpu")
    return tensor.pin_memory() if device.type == "cuda" else tensor


def host_copies_done(device: torch.device) -> None:
    """Wait until every copy enqueued on ``device``'s current stream has landed (a no-op on the
    CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
