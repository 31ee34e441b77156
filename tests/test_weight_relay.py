"""The order of rollout.weight_relay's loads (rlray/driver/weight_relay.py), by hand."""

import pytest

from rlray.config import Config, ConfigError, validate
from rlray.driver.weight_relay import relay_waves


def test_each_wave_reaches_as_many_new_nodes_as_hold_the_weights():
    nodes = ["A", "A", "B", "B", "C", "D", "E", "E", "F"]
    # A publishes: its workers load first; then B (1 holder), C and D (2), E and F (4).
    assert relay_waves(nodes, "A") == [[0, 1], [2, 3], [4, 5], [6, 7, 8]]


def test_the_waves_grow_as_powers_of_two_from_a_node_without_workers():
    nodes = [f"node-{i}" for i in range(16)]
    waves = relay_waves(nodes, "learner-node")
    assert [len(wave) for wave in waves] == [1, 2, 4, 8, 1]
    assert sorted(w for wave in waves for w in wave) == list(range(16))  # each once


def test_workers_of_one_node_load_in_one_wave():
    assert relay_waves(["B", "C", "B"], "A") == [[0, 2], [1]]
    assert relay_waves(["A", "A"], "A") == [[0, 1]]


def test_the_relay_is_refused_where_weights_do_not_go_through_the_object_store():
    config = Config()
    config.rollout.weight_relay = True
    validate(config)  # on CPU, auto is the object store
    config.rollout.weight_sync = "gloo"
    with pytest.raises(ConfigError, match="weights go by gloo"):
        validate(config)
