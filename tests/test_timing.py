"""PhaseClock: a step's wall time split by what the driver waited on, adding up."""

from __future__ import annotations

import time

import pytest

from rlray.observe.timing import PHASES, PhaseClock, describe_totals


def test_a_lap_splits_its_wall_time_into_phases_and_the_rest():
    clock = PhaseClock()
    with clock.phase("training"):
        time.sleep(0.05)
    time.sleep(0.03)
    clock.add("generation", 0.01)  # a wait measured elsewhere, within the last 0.03 s
    split = clock.lap()
    assert set(split) == {*PHASES, "other", "total"}
    assert split["training"] >= 0.05 and split["generation"] == 0.01
    assert split["other"] >= 0.02  # the rest of the 0.03 s, outside any phase
    assert sum(v for k, v in split.items() if k != "total") == pytest.approx(split["total"])


def test_laps_start_afresh_and_totals_add_them_up():
    clock = PhaseClock()
    clock.add("scoring", 2.0)
    first = clock.lap()
    clock.add("scoring", 3.0)
    clock.add("store", 1.0)
    second = clock.lap()
    assert (first["scoring"], second["scoring"], second["store"]) == (2.0, 3.0, 1.0)
    assert clock.totals["scoring"] == 5.0 and clock.totals["store"] == 1.0
    assert clock.totals["total"] == pytest.approx(first["total"] + second["total"])


def test_nested_or_unknown_phases_are_refused():
    clock = PhaseClock()
    refused = pytest.raises(RuntimeError, match="'buffer' started inside phase 'training'")
    with refused, clock.phase("training"), clock.phase("buffer"):
        pass
    with clock.phase("buffer"):  # the failed nesting left no phase open
        pass
    with pytest.raises(ValueError, match="unknown phase 'sleeping'"):
        clock.add("sleeping", 1.0)


def test_totals_are_described_largest_first_with_shares_of_the_wall_time():
    totals = dict.fromkeys((*PHASES, "other"), 0.0)
    totals.update(training=60.0, generation=30.0, weight_sync=6.0, other=4.0, total=100.0)
    assert describe_totals(totals) == (
        "training 60 s (60%), generation 30 s (30%), weight_sync 6 s (6%), other 4 s (4%)"
    )
