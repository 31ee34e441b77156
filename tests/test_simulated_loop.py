"""The training loop with simulated engines and learner on a many-node Ray
(benchmarks/simulated_loop.py, benchmarks/chaos_soak.py): the soak's short version,
every kind of fault once, in turn, and how the loop's figures are taken."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.jobs_helper import REPO


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(REPO / "benchmarks"))  # it imports control_plane beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_a_steps_figures_are_its_time_over_the_modelled_one():
    loop = load_script("simulated_loop")
    shape = loop.Shape(workers=4, steps=6, completion_tokens=1024)
    # 7B profile: a batch of 16 x 1,024 tokens decodes at 150 tokens/s a sequence
    # (6.83 s) after 8,192 prompt tokens at 28,000/s; a load of 14 GB at 25 GB/s.
    assert shape.modelled_step_s() == pytest.approx(8192 / 28000 + 1024 / 150 + 14 / 25)
    steps = [
        loop.StepRecord(
            # the last step's 25 s hold the run's final evaluation: left out
            {
                "elapsed_seconds": 10.0 * i + 15.0 * (i == 5),
                "weight_sync_seconds": 1.0,
                "weight_load_seconds": 1.5,
                "phase_seconds": {"weight_sync": 0.25},
            },
            driver_cpu_s=0.5 * i,
            seen_at=0.0,
            machine_cpu_s=4.0 * i,
        )
        for i in range(6)
    ]
    figures = loop.figures(loop.RunResult(steps), shape)
    assert figures["step_s"] == pytest.approx(10.0)  # steps 2-4: 2 intervals of 10 s
    assert figures["driver_cpu_s"] == pytest.approx(0.5)
    assert figures["overhead_s"] == pytest.approx(10.0 - shape.modelled_step_s())
    assert figures["weight_sync_s"] == pytest.approx(1.0)
    assert figures["weight_load_s"] == pytest.approx(1.5 - 14 / 25)
    assert figures["sync_wait_s"] == pytest.approx(0.25)
    assert figures["machine_cpu_s"] == pytest.approx(4.0)


@pytest.mark.slow
def test_the_short_soak_loses_and_doubles_nothing_through_each_kind_of_fault():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, str(REPO / "benchmarks" / "chaos_soak.py"), "--quick"]
    command += ["--weight-relay", "--store-shards", "2"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    faults = re.findall(r"^  fault: (.+?) \(", run.stdout, re.M)
    # In turn: a rollout worker, a reward worker, the buffer and store, an engine node,
    # the second store shard.
    kinds = ["rollout worker", "reward worker", "buffer and store", "engine node", "store shard"]
    assert faults[:5] == kinds, run.stdout[-3000:]
    assert "every episode stored exactly once; nothing hung; every parity check 0" in out
    stored = int(re.search(r"^episodes stored: (\d+)$", run.stdout, re.M)[1])
    handed_out = int(re.search(r"^prompts handed out: (\d+)$", run.stdout, re.M)[1])
    assert stored == 4 * handed_out > 0
