"""A learner's turns on a device it shares with a rollout engine (the colocated
placement): what it gives back for the engine's turn, and takes again for its own."""

from __future__ import annotations

import torch


class OptimizerOffload:
    """Moves an optimizer's state between its device and pinned host memory."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, world_size: int):
        self.optimizer = optimizer
        self.device = device
        self.world_size = world_size
        self._host_buffers: dict[tuple[int, str], torch.Tensor] = {}
        self._offloaded: set[tuple[int, str]] = set()
        """The optimizer's state tensors now in host memory (release)."""

    def release(self, offload_optimizer: bool) -> None:
        """The engine's turn on this learner's devices: the allocator's cached blocks go
        back to the device, so that a waking rollout engine can map them, and with
        `offload_optimizer` the optimizer's state goes to host memory (AdamW's two
        moments: twice the trained weights' bytes)."""
        if offload_optimizer and self.device.type != "cpu":
            self._move(to_host=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reclaim(self) -> None:
        """The learner's turn: brings back whatever release offloaded."""
        if self._offloaded:
            self._move(to_host=False)

    def _move(self, to_host: bool) -> None:
        """Copies the state tensors that live on the device into pinned host buffers,
        kept for the next turn (pinning costs more than the copy), or back. AdamW's
        `step` counters stay where the optimizer keeps them (on the host)."""
        if self.world_size > 1:  # config checks refuse it: a DTensor's shard is not moved
            raise ValueError("offloading a sharded optimizer's state is not built")
        for index, state in enumerate(self.optimizer.state.values()):
            for name, value in state.items():
                slot = (index, name)
                if to_host and value.device.type == self.device.type:
                    host = self._host_buffers.get(slot)
                    if host is None or host.shape != value.shape or host.dtype != value.dtype:
                        host = torch.empty_like(value, device="cpu", pin_memory=True)
                        self._host_buffers[slot] = host
                    state[name] = host.copy_(value, non_blocking=True)
                    self._offloaded.add(slot)
                elif not to_host and slot in self._offloaded:
                    state[name] = value.to(self.device, non_blocking=True)
        if not to_host:
            self._offloaded.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the host copies are whole before the engine runs
