"""benchmarks/control_plane.py at its smallest: a Ray cluster of two nodes on this
machine, every figure produced and sane, every episode sent to a store stored once; and
how it names the growth of a figure."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.jobs_helper import REPO

SCRIPT = REPO / "benchmarks" / "control_plane.py"


def load_script():
    spec = importlib.util.spec_from_file_location("control_plane", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_growth_is_named_from_the_slope_of_the_figures():
    growth = load_script().growth
    assert growth([8, 32, 64], [5.0, 5.2, 4.9]).startswith("constant")
    assert growth([8, 32, 64], [1.0, 4.1, 7.9]).startswith("linear")
    assert growth([8, 32, 64], [1.0, 16.0, 64.0]).startswith("worse than linear")
    assert growth([8], [1.0]) == "-"


@pytest.mark.slow
def test_the_smallest_run_measures_every_part_and_stores_each_episode_once(tmp_path):
    out = tmp_path / "figures.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT), "--quick", "--nodes", "2", "--workers", "1", "2"]
    command += ["--sizes-mb", "4", "--buffer-seconds", "1", "--store-episodes", "256"]
    command += ["--steps", "2", "--batch-episodes", "32", "--bookkeeping-workers", "8", "16"]
    command += ["--store-shards", "1", "2"]  # every episode stored once by two shards too
    command += ["--json", str(out)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    written = json.loads(out.read_text())
    results = written["results"]["2"]
    assert sorted(results) == ["1", "2"]
    for workers, figures in results.items():
        for name, value in figures.items():
            assert math.isfinite(value) and value > 0, (workers, name, value)
        assert figures["store_rows"] == figures["store_sent"] == 256
        assert "store_2_shards_over_one" in figures
        # a warm-up step and two timed ones, each a batch of 8 prompts x 4 samples a worker
        assert figures["driver_stored"] == 3 * int(workers) * 32
        assert figures["buffer_cpu_ms_per_batch"] < 1000
    assert sorted(written["bookkeeping"]) == ["16", "8"]
    assert all(v > 0 for scans in written["bookkeeping"].values() for v in scans.values())
    assert "results, 2 nodes" in run.stdout and "growth" in run.stdout
