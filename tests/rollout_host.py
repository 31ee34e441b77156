"""One Ray process that holds rollout actors for the tests, one after another.

Starting a Ray actor process and importing vLLM in it takes most of a rollout test's
time (about 12 of 17 s on 2 cores). The session's RolloutHost holds one RolloutActor at
a time, constructed exactly as rlray constructs one, and forwards the calls the tests
make to it (tests/test_architectures.py, tests/test_multiturn.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from rlray.cluster.roles import RolloutActor
from rlray.config import ModelConfig, RolloutConfig
from rlray.rollout.worker import vllm_env

# Every test's rollout uses this config, so one vllm_env serves them all. Its engines take
# weights both ways: published objects and vLLM's weight transfer (over gloo here).
HOST_NAME = "rollout-host"
"""The session's RolloutHost actor's name (the agent endpoint finds rollout actors by name)."""

ROLLOUT = RolloutConfig(samples_per_prompt=2, max_new_tokens=8, weight_sync="gloo")


class RolloutHost:
    """One process for every test's RolloutActor: starting a Ray actor process and
    importing vLLM in it took most of each test's time (about 12 of 17 s on a 2-core
    machine). It holds one RolloutActor at a time, constructed exactly as rlray
    constructs one, and forwards the calls the tests make to it."""

    def __init__(self) -> None:
        self.rollout: RolloutActor | None = None

    def start(self, *args: Any) -> None:
        """Replaces the held RolloutActor by RolloutActor(*args)."""
        self.stop()
        self.rollout = RolloutActor(*args)

    def stop(self) -> None:
        """Shuts the held engine down (RolloutWorker.close), so the next can start."""
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
            gc.collect()

    def generate(self, *args: Any) -> Any:
        return self.rollout.generate(*args)

    def complete(self, *args: Any) -> Any:
        return self.rollout.complete(*args)

    def complete_calls(self, calls: list) -> Any:
        return self.rollout.complete_calls(calls)

    def load_published(self, published: Any) -> tuple[int, float]:
        # Ray resolved the object reference for this call, as it does for an actor's.
        return self.rollout.load_published(published)

    # The weight-transfer calls a learner's RolloutClient makes (rlray.weights.transfer).

    def open_weight_transfer(self, init_info: dict) -> None:
        self.rollout.open_weight_transfer(init_info)

    def start_weight_update(self) -> None:
        self.rollout.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.rollout.update_weights(update_info)

    def finish_weight_update(self, version: int) -> None:
        self.rollout.finish_weight_update(version)

    def loads_tied_output(self, tied_output: str) -> bool:
        return self.rollout.loads_tied_output(tied_output)

    def policy_version(self) -> int:
        return self.rollout.policy_version


@contextlib.contextmanager
def started_host() -> Iterator:
    """Yields a RolloutHost actor, started with a rollout actor's resources and
    environment (read when its process starts, as by a RolloutActor's); kills it after."""
    host = (
        ray.remote(RolloutHost)
        .options(name=HOST_NAME, num_cpus=1, runtime_env={"env_vars": vllm_env(ROLLOUT)})
        .remote()
    )
    try:
        yield host
    finally:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(host.stop.remote(), timeout=60)
        ray.kill(host, no_restart=True)


@contextlib.contextmanager
def rollout_actor(
    host, model_dir: Path, dtype: str, max_model_len: int = 64, rollout: RolloutConfig = ROLLOUT
) -> Iterator:
    """Yields the host holding a RolloutActor on the model, built with the arguments rlray
    builds one with (`rollout`: ROLLOUT, or settings that need no other vllm_env); shuts
    its engine down after."""
    assert vllm_env(rollout) == vllm_env(ROLLOUT), "the host's process has ROLLOUT's"
    model = ModelConfig(path=str(model_dir), dtype=dtype, max_model_len=max_model_len)
    args = (f"rollout-{model_dir.name}", str(model_dir), model, rollout, "tests", 0)
    ray.get(host.start.remote(*args), timeout=300)
    try:
        yield host
    finally:
        ray.get(host.stop.remote(), timeout=60)
