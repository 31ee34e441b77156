"""A long wait says what it is doing: rlray.core.waiting's countdown and the durations
it takes its estimates from."""

from __future__ import annotations

import io
import json
import threading

import pytest

from rlray.core.waiting import Countdown, Durations, duration, timed_wait


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(io.StringIO):
    """A console that notes when a line arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        self.arrived.set()
        return written


def test_durations_read_as_seconds_or_minutes_and_seconds():
    assert duration(0) == "0s"
    assert duration(42.9) == "42s"
    assert duration(60) == "1m00s"
    assert duration(187) == "3m07s"


def test_the_countdown_says_its_estimate_counts_down_and_says_when_it_overruns():
    clock, out = FakeClock(), io.StringIO()
    countdown = Countdown("building tiny", 90, out=out, every_s=3600, clock=clock).start()
    clock.now += 20
    countdown.tick()
    clock.now += 40
    countdown.tick()
    clock.now += 40
    countdown.tick()
    assert countdown.stop() == 100
    assert out.getvalue().splitlines() == [
        "building tiny: ~1m10s left",
        "building tiny: ~30s left",
        "building tiny: taking longer than expected, 1m40s so far",
    ]


def test_a_stopped_countdown_keeps_its_duration():
    clock = FakeClock()
    countdown = Countdown("x", 10, out=io.StringIO(), every_s=3600, clock=clock).start()
    clock.now += 5
    countdown.stop()
    clock.now += 50
    assert countdown.elapsed() == 5


def test_a_wait_that_ends_before_the_first_interval_prints_nothing():
    out = io.StringIO()
    with Countdown("starting the actors", 60, out=out, every_s=3600):
        pass
    assert out.getvalue() == ""


def test_the_countdown_prints_from_a_thread_of_its_own_until_stopped():
    out = Lines()
    countdown = Countdown("starting the actors", 60, out=out, every_s=0.01).start()
    assert out.arrived.wait(timeout=30)
    countdown.stop()
    printed = out.getvalue()
    assert printed.startswith("starting the actors: ~")
    out.arrived.clear()
    assert not out.arrived.wait(timeout=0.1)  # no line after stop()
    assert out.getvalue() == printed


def test_a_timed_wait_counts_down_from_the_last_duration_here_else_its_default(tmp_path):
    waits = Durations(tmp_path / "waits.json")
    with timed_wait("building tiny", "build tiny", waits, 120, io.StringIO()) as first:
        pass
    assert first.estimate_s == 120
    waits.record("build tiny", 75.0)
    with timed_wait("building tiny", "build tiny", waits, 120, io.StringIO()) as second:
        pass
    assert second.estimate_s == 75
    assert "build tiny" in json.loads((tmp_path / "waits.json").read_text())


def test_a_failed_wait_records_no_duration(tmp_path):
    waits = Durations(tmp_path / "waits.json")
    with (
        pytest.raises(RuntimeError),
        timed_wait("building tiny", "build tiny", waits, 120, io.StringIO()),
    ):
        raise RuntimeError("the build failed")
    assert waits.last("build tiny") is None
    assert not (tmp_path / "waits.json").exists()


def test_durations_are_kept_per_wait_in_the_cache_folder(tmp_path):
    waits = Durations.in_folder(tmp_path)
    waits.record("build tiny-arithmetic", 61.27)
    waits.record("start-up builtin:tiny-arithmetic", 30)
    again = Durations.in_folder(tmp_path)
    assert again.last("build tiny-arithmetic") == 61.3
    assert again.last("start-up builtin:tiny-arithmetic") == 30
    assert again.last("build tiny-countdown") is None


def test_an_unreadable_or_unwritable_durations_file_is_as_good_as_none(tmp_path):
    broken = tmp_path / "waits.json"
    broken.write_text("{not json")
    waits = Durations(broken)
    assert waits.last("build tiny") is None
    waits.record("build tiny", 12)
    assert waits.last("build tiny") == 12
    (tmp_path / "a-file").write_text("")
    nowhere = Durations(tmp_path / "a-file" / "waits.json")  # its folder is a file
    nowhere.record("build tiny", 12)
    assert nowhere.last("build tiny") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "waits.json"]
