"""The weight transfer's backends as vLLM's factories build them. The NCCL sender needs
GPUs, but a learner group's other ranks take the NCCL engine's non-sender path, which
holds no communicator and calls no rollout worker: that part runs here as on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

from rlray.config import Config
from rlray.data.models import resolve_model_path
from rlray.weights.transfer import (
    GlooTrainerInitInfo,
    PolicySource,
    TransferSender,
    trainer_init_info,
)


@pytest.mark.parametrize(
    ("backend", "info_type"), [("gloo", GlooTrainerInitInfo), ("nccl", NCCLTrainerInitInfo)]
)
def test_each_backend_has_its_init_info_and_rank_0_alone_sends(backend, info_type):
    infos = [trainer_init_info(backend, "10.0.0.7", 29511, 3, rank, 60.0) for rank in (0, 1)]
    assert [type(info) for info in infos] == [info_type, info_type]
    assert [info.backend for info in infos] == [backend, backend]
    assert [info.is_sender for info in infos] == [True, False]
    assert {(i.master_address, i.master_port, i.world_size) for i in infos} == {
        ("10.0.0.7", 29511, 3)
    }


class NoRolloutWorkers:
    """A client that fails the test if a non-sending learner calls it."""

    def __getattr__(self, name: str):
        raise AssertionError(f"a non-sending learner called the rollout workers: {name}")


class CountingSource(PolicySource):
    def __init__(self, *args):
        super().__init__(*args)
        self.yielded = 0

    def __iter__(self):
        for item in super().__iter__():
            self.yielded += 1
            yield item


def test_a_non_sending_learner_on_nccl_walks_the_weights_and_calls_no_worker():
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(Config().model.path), dtype=torch.float32
    )
    source = CountingSource(model, torch.bfloat16, None)
    sender = TransferSender(
        "nccl", source, NoRolloutWorkers(), 1, "127.0.0.1", 29511, 3, timeout_s=60.0
    )
    assert type(sender.engine) is NCCLTrainerWeightTransferEngine
    assert sender.engine.model_update_group is None  # rank 0 alone opens the NCCL group
    sender.send(version=4)
    # Every weight is produced once: in a sharded group each is a gather all ranks join.
    assert source.yielded == len(source.metadata()) > 0
    sender.close()
