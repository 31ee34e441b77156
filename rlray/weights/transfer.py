"""Weight sync through vLLM's weight-transfer engine: the learner sends every tensor
straight to the rollout workers' vLLM engines over a process group of their own, instead
of publishing one object to Ray's object store.

One path, two transports:
- "nccl" is vLLM's own NCCL engine (learner and rollout workers on GPUs);
- "gloo" is registered here: vLLM's engine API and its NCCL engine's lifecycle
  (layerwise reload, the trainer driving start/update/finish through a client), with the
  tensors broadcast over a torch gloo group. It runs on CPU, so the GPU path's code is
  tested on machines without one, and only the transport differs.

The learner's side (`TransferSender`) holds a `PolicySource` (vLLM's `WeightSource`: the
policy's HF-named weights in the rollout dtype, LoRA merged, shards gathered one tensor
at a time) and a client of vLLM's weight-sync protocol that makes the rollout actors'
calls, each with a timeout (rlray.cluster.learners.RolloutClient). Every learner of a
group runs the sender (each takes part in the gathers); rank 0 alone talks to the
rollout workers. This module imports vLLM's weight-transfer modules (not its engine):
import it only where the transfer is used.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    WeightSource,
    WeightTransferInitInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferUpdateInfo,
)

from rlray.weights.packing import input_embedding_name, merged_parameters, published_shapes


class GlooGroup:
    """A gloo process group of the learner (rank 0) and the rollout engines, apart from
    torch.distributed's default group (which the learner group, or vLLM, holds), with the
    one call the engines use of NCCL's communicator: broadcast."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(address, port, world_size, rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.store = store  # the group's peers find each other through it: keep it alive

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def destroy(self) -> None:
        self.group, self.store = None, None


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """What a rollout engine needs to join the group: rank 0's address and port, its
    rank offset and the group's size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """What a learner needs to open (rank 0) or join the transfer."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL engine (layerwise reload at start and finish), receiving one tensor at
    a time over a gloo group."""

    init_info_cls = GlooInitInfo  # type: ignore[assignment]
    update_info_cls = NCCLWeightTransferUpdateInfo

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:  # type: ignore[override]
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.model_update_group = GlooGroup(  # type: ignore[assignment]
            init_info.master_address,
            init_info.master_port,
            rank + init_info.rank_offset,
            init_info.world_size,
            init_info.timeout_s,
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receiving; here there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError("gloo weight transfer: init_transfer_engine first")
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
            self.model_update_group.broadcast(weight, src=0)
            self.model.load_weights([(name, weight)])


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine (start, update beside the broadcast, finish; each tensor
    checked against the metadata sent ahead), broadcasting over a gloo group."""

    init_info_cls = GlooTrainerInitInfo  # type: ignore[assignment]

    @classmethod
    def trainer_init(  # type: ignore[override]
        cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        joining = GlooInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # The engines wait in their join until rank 0 opens the group: both at once.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(joining))
            engine.model_update_group = GlooGroup(  # type: ignore[assignment]
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
            )
            joined.result()
        return engine

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta]) -> None:
        if not self.is_sender:
            for _ in source:  # the gathers are collectives of every learner
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.contiguous(), src=0)


def register_backends() -> None:
    """Registers the gloo engines with vLLM's factories (once per process)."""
    for factory, engine in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        # ValueError: registered already, by an earlier call in this process.
        with contextlib.suppress(ValueError):
            factory.register_engine("gloo", engine)


def trainer_init_info(
    backend: str, address: str, port: int, world_size: int, rank: int, timeout_s: float
) -> TrainerInitInfo:
    """Returns the trainer-side init info of `backend` for one learner of the group."""
    if backend == "gloo":
        return GlooTrainerInitInfo(address, port, world_size, timeout_s, rank=rank)
    return NCCLTrainerInitInfo(address, port, world_size, rank=rank)


class PolicySource(WeightSource):
    """The policy's weights as vLLM's WeightSource: HF names (LoRA merged, shards gathered
    one at a time by every learner) cast to the rollout dtype, and `tied_output` (the
    output embedding's name, when the rollout model loads it; None otherwise) last, as
    the input embedding's tensor."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, tied_output: str | None):
        self.model, self.dtype, self.tied_output = model, dtype, tied_output
        self.input_embedding = input_embedding_name(model) if tied_output else None

    def metadata(self) -> list[ParamMeta]:
        shapes = published_shapes(self.model)
        if self.tied_output is not None:
            shapes.append((self.tied_output, dict(shapes)[self.input_embedding]))
        return [ParamMeta(name, self.dtype, shape) for name, shape in shapes]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        embedding = None
        for name, tensor in merged_parameters(self.model):
            cast = tensor.to(self.dtype)
            if name == self.input_embedding:
                embedding = cast
            yield name, cast
        if self.tied_output is not None:
            yield self.tied_output, embedding


class TransferSender:
    """A learner's end of the transfer: opened once with the rollout workers (every learner
    of a group opens it; rank 0 opens the group and drives the workers), then `send`
    after each step."""

    def __init__(
        self,
        backend: str,
        source: PolicySource,
        client: Any,
        rank: int,
        address: str,
        port: int,
        world_size: int,
        timeout_s: float,
    ):
        register_backends()
        info = trainer_init_info(backend, address, port, world_size, rank, timeout_s)
        self.client = client
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)

    def send(self, version: int) -> None:
        """Sends the current weights; the workers then hold `version`."""
        self.client.version = version
        self.engine.send_weights()

    def close(self) -> None:
        self.engine.shutdown()
