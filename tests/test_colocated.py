"""The colocated placement's parts that run without an engine: whose turn the devices are
(the engine sleeps while the learner trains, on GPU), and the config's rules. A real
colocated run is tests/test_job.py's (the same steps as the disaggregated run)."""

from __future__ import annotations

import pytest

from rlray.cluster.colocated import EngineTurns
from rlray.config import Config, ConfigError, validate, weight_sync


class Engine:
    """vLLM's sleep and wake_up as a GPU engine has them, recording each call."""

    def __init__(self):
        self.calls: list[str] = []

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def test_the_engine_sleeps_once_per_learner_turn_and_wakes_once_per_engine_turn():
    engine = Engine()
    turns = EngineTurns(engine.sleep, engine.wake_up)
    # A step with max_staleness 0: generate, train, load the new weights, generate again.
    turns.engine()  # awake from the start: nothing to do
    turns.learner()
    turns.learner()  # a parity check after the step: still the learner's turn
    turns.engine()  # the weight load wakes the engine...
    turns.engine()  # ...and the next generation finds it awake
    assert engine.calls == ["sleep", "wake_up"]
    assert turns.turns == ["learner", "engine"]
    # An evaluation between two steps, and two steps back to back (sync_every 2).
    turns.learner()
    turns.learner()
    turns.engine()
    assert engine.calls == ["sleep", "wake_up", "sleep", "wake_up"]


def test_an_engine_that_cannot_sleep_keeps_the_turns_only():
    turns = EngineTurns()  # vLLM's CPU backend: no sleep mode
    for turn in ("engine", "learner", "engine", "learner", "learner", "engine"):
        getattr(turns, turn)()
    assert turns.turns == ["learner", "engine", "learner", "engine"]
    assert turns.engine_awake


def test_the_learner_gives_memory_up_before_the_engine_wakes_and_takes_it_after_it_sleeps():
    engine = Engine()
    turns = EngineTurns(
        engine.sleep,
        engine.wake_up,
        lambda: engine.calls.append("learner releases"),
        lambda: engine.calls.append("learner reclaims"),
    )
    turns.engine()  # awake from the start: the actor's setup released the learner's memory
    turns.learner()
    turns.learner()
    turns.engine()
    assert engine.calls == ["sleep", "learner reclaims", "learner releases", "wake_up"]
    release, reclaim = (lambda: engine.calls.append("r")), (lambda: engine.calls.append("c"))
    cpu = EngineTurns(None, None, release, reclaim)
    cpu.learner()
    cpu.engine()
    assert engine.calls[-2:] == ["c", "r"]  # no sleep mode: the learner's part still runs


def colocated(**fields) -> Config:
    config = Config()
    config.ray.placement = "colocated"
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(config, section), name, value)
    return config


def test_a_colocated_engine_takes_its_weights_in_memory():
    config = colocated()
    validate(config)
    validate(colocated(rollout__num_workers=2, learner__num_workers=2))  # a group
    assert weight_sync(config) == "in_memory"
    config.ray.placement = "disaggregated"
    assert weight_sync(config) == "object_store"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rollout__num_workers": 2},
            r"^rollout.num_workers \(2\) must equal learner.num_workers \(1\) with ray.placement "
            "colocated",
        ),
        (
            {"rollout__weight_sync": "gloo"},
            r"^rollout.weight_sync gloo with ray.placement colocated",
        ),
        (
            {"learner__gpus": 1.0},
            r"^rollout.gpus_per_worker \(0.0\) must equal learner.gpus \(1.0\)",
        ),
        (
            {
                "learner__gpus": 1.0,
                "rollout__gpus_per_worker": 1.0,
                "rollout__in_flight_updates": True,
                "rollout__in_flight_kv_cache": "keep",
            },
            r"^rollout.in_flight_kv_cache keep with ray.placement colocated on GPUs: the "
            "engine's sleep frees the KV cache",
        ),
        (
            {"ray__placement": "disaggregated", "learner__offload_optimizer": True},
            r"^learner.offload_optimizer needs ray.placement colocated",
        ),
        (
            {
                "learner__offload_optimizer": True,
                "learner__num_workers": 2,
                "rollout__num_workers": 2,
            },
            r"^learner.offload_optimizer with learner.num_workers 2: offloading a sharded",
        ),
    ],
)
def test_what_colocation_cannot_do_is_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        validate(colocated(**fields))
