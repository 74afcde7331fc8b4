"""Activation offload (``parallel.activation_offload``): a layer's saved tensors in host memory between its forward
and its backward, back one layer ahead of that backward.

Megatron's fine-grained activation offload, DeepSpeed's and MaxText's offload policies do this through the
autograd's saved-tensor hooks, as here: while an offloaded layer runs forward, each tensor autograd saves is copied
to a host buffer (pinned, on a side stream, on CUDA) and autograd keeps only a handle, so the device copy is freed
once the layer's forward no longer uses it. Parameters (and their views) stay: they are model state. A storage
saved several times (a norm's output read by q, k and v) is copied once. In backward, the first tensor a layer's
backward asks for brings its whole group back, and starts bringing back the previous layer's (the next backward):
one layer of prefetch. Under recomputation the hooks see what the checkpoint keeps outside the layer (its input;
selective: the projections' outputs); op-level recomputation's kept outputs live in its policy's cache and stay.

On the CPU the copies still run and are counted (``to_host_bytes``, ``to_device_bytes``; ``held``: the host bytes
alive, a group's until autograd lets go of its layer, and their peak, which the run's plan check compares with the
planner's ``offloaded_to_host``): the mechanism and its bytes are tested there; the freed device memory is a GPU
matter.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class LiveBytes:
    """Bytes alive outside autograd's saved tensors (offloaded to the host, or kept in op-level recomputation's
    cache) and their peak since ``reset_peak``; ``listeners`` hear every change (the plan check's saved-bytes
    tracker adds the policy's cache to what its hooks see)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.listeners: list[Callable[[int], None]] = []

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)
        for listener in self.listeners:
            listener(n)

    def release(self, held: list[int]) -> None:
        """Release what ``held`` (one owner's running count) still holds."""
        n, held[0] = held[0], 0
        if n:
            self.add(-n)

    def reset_peak(self) -> None:
        self.peak = self.live


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class _Group:
    """One layer's forward: its saved storages, on the host after forward, on the device again for backward."""

    def __init__(self, offload: ActivationOffload) -> None:
        self.offload = offload
        self.host: dict[int, torch.UntypedStorage] = {}
        self.device: dict[int, torch.UntypedStorage] = {}  # brought back (or, during forward, not yet copied)
        self.event: Any = None  # CUDA: the copies' completion on the side stream
        # the layer whose forward ran just before: its backward comes next (alive while its graph is)
        self.previous: weakref.ref[_Group] | None = None
        self.held = [0]  # its host bytes, released with the group (once autograd lets go of its handles)
        weakref.finalize(self, offload.held.release, self.held)

    def pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.host:
            cuda = storage.device.type == "cuda"
            host = torch.UntypedStorage(storage.nbytes(), device="cpu")
            host = host.pin_memory() if cuda else host
            with self.offload.side_stream():
                host.copy_(storage, non_blocking=cuda)
            self.host[key] = host
            self.device[key] = storage  # held until the copy completes (end of the layer's forward)
            self.offload.to_host_bytes += storage.nbytes()
            self.held[0] += storage.nbytes()
            self.offload.held.add(storage.nbytes())
        return (self, key, t.dtype, t.size(), t.stride(), t.storage_offset(), t.device)

    def close(self) -> None:
        """End of the layer's forward: once the copies are done, drop the device storages."""
        if self.offload.stream is not None:
            self.offload.stream.synchronize()
        self.device.clear()

    def fetch(self) -> None:
        """Bring every storage of the group back to its device (once)."""
        if self.device or not self.host:
            return
        for key, host in self.host.items():
            storage = torch.UntypedStorage(host.nbytes(), device=self.offload.device)
            with self.offload.side_stream():
                storage.copy_(host, non_blocking=storage.device.type == "cuda")
            self.device[key] = storage
            self.offload.to_device_bytes += host.nbytes()
        if self.offload.stream is not None:
            self.event = torch.cuda.Event()
            self.event.record(self.offload.stream)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        _, key, dtype, size, stride, offset, device = packed
        if not self.device:
            self.fetch()
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.fetch()  # one layer of prefetch
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return torch.empty(0, dtype=dtype, device=device).set_(self.device[key], offset, size, stride)


class ActivationOffload:
    """The offload of one model's layers (``Transformer.offloaded``): the copies' counts, the side stream, the
    last layer's group (each group lives as long as the autograd graph holds its handles)."""

    def __init__(self) -> None:
        self.last: weakref.ref[_Group] | None = None
        self.to_host_bytes = 0
        self.to_device_bytes = 0
        self.held = LiveBytes()  # host bytes of the groups alive
        self.stream: Any = None
        self.device: torch.device = torch.device("cpu")

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def layer(self, x: torch.Tensor) -> Iterator[None]:
        """One offloaded layer's forward (``x``: its input, which says the device)."""
        self.device = x.device
        if x.device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream()
        group = _Group(self)
        group.previous, self.last = self.last, weakref.ref(group)
        with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
            yield
        group.close()
