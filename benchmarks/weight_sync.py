"""Weight-sync seconds against state-dict size, with one and two rollout workers, by
each path a CPU run can take.

For each model, in one run: the real sync path, timed from the driver
(TrainingDriver.sync_weights), against one in-memory copy of the same bytes (clone of
every tensor of the state dict) in this process; a copy into memory already allocated is
printed alongside, for scale. The paths (rollout.weight_sync): object_store (the learner
actor publishes its weights once into the object store, every rollout actor loads them
into vLLM in place and resets its prefix cache) and gloo (vLLM's weight-transfer engine:
the learner broadcasts tensor by tensor into every engine, which loads them layer by
layer). Models: the embedded tiny model, and a ~0.5 GB synthetic Qwen2 of the same
architecture (random weights, built here, never downloaded). Goal: sync <= 3x copy.

    python benchmarks/weight_sync.py [--repeats 5] [--skip-large] [--paths object_store gloo]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray
import torch

from rlray.cluster.start import start_actors
from rlray.config import Config
from rlray.data.models import resolve_model_path
from rlray.data.prompts import eval_rows, train_prompts
from rlray.data.tiny_models import random_char_model
from rlray.driver.plan import RunPlan
from rlray.driver.training import TrainingDriver


def build_large_model(out: Path) -> Path:
    """Saves a random ~0.5 GB (fp32) Qwen2: hidden 1024, 8 layers, head_dim 64."""
    random_char_model(out, hidden=1024, layers=8, max_positions=64)
    return out


def copy_seconds(model_path: str, repeats: int) -> tuple[float, float, int]:
    """Returns the median seconds of one copy of the state dict (a clone: allocate and
    copy, the goal's baseline), of a copy into memory already allocated and touched,
    and the state dict's size in bytes."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())
    clones, into = [], []
    target = {name: torch.empty_like(tensor).fill_(0) for name, tensor in state.items()}
    for _ in range(repeats):
        started = time.perf_counter()
        copy = {name: tensor.clone() for name, tensor in state.items()}
        clones.append(time.perf_counter() - started)
        del copy
        started = time.perf_counter()
        for name, tensor in state.items():
            target[name].copy_(tensor)
        into.append(time.perf_counter() - started)
    return statistics.median(clones), statistics.median(into), size


def sync_seconds(
    model_path: str, workers: int, path: str, repeats: int, run_dir: Path
) -> tuple[float, float | None]:
    """Returns the median wall seconds of TrainingDriver.sync_weights with `workers` actors
    and weight sync `path`, and the median of its slowest worker's load (vLLM reload +
    prefix-cache reset; None for a transfer, whose loads happen inside the send)."""
    config = Config()
    config.rollout.num_workers = workers
    config.rollout.weight_sync = path
    config.model.path = model_path
    config.run_dir = str(run_dir)
    # With staleness >= 1 (the default) each sync is followed by its parity check, a
    # phase of its own: not the sync's time, and left out here.
    config.buffer.max_staleness = 0
    plan = RunPlan(
        config,
        run_dir,
        "bench",
        model_path,
        train_prompts(config.data, 0),
        eval_rows(config.data),
        None,
    )
    actors = start_actors(config, model_path, "bench", None)
    try:
        driver = TrainingDriver(plan, actors, version=0, prompt_cursor=0)
        driver.sync_weights()  # warm-up (and a transfer's opening)
        timings = [driver.sync_weights() for _ in range(repeats)]
        assert all(t["weight_sync"] == path for t in timings), timings
        loads = [t["weight_load_seconds"] for t in timings]
        return (
            statistics.median(t["weight_sync_seconds"] for t in timings),
            None if None in loads else statistics.median(loads),
        )
    finally:
        actors.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--paths", nargs="+", default=["object_store", "gloo"])
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="rlray-bench-") as scratch:
        models = {"tiny": resolve_model_path(Config().model.path)}
        if not args.skip_large:
            models["large"] = str(build_large_model(Path(scratch) / "large"))
        for name, path in models.items():
            copy, copy_into, size = copy_seconds(path, args.repeats)
            for workers in (1, 2):
                for sync_path in args.paths:
                    run = Path(scratch) / "run"
                    sync, load = sync_seconds(path, workers, sync_path, args.repeats, run)
                    slowest = "-" if load is None else f"{load:.4f} s"
                    print(
                        f"{name:<5} {size / 2**20:8.1f} MiB  workers {workers}  "
                        f"{sync_path:<12}  sync {sync:8.4f} s  (slowest worker load {slowest})"
                        f"  one copy {copy:8.4f} s  ratio {sync / copy:6.2f}  "
                        f"(copy into allocated memory {copy_into:8.4f} s)",
                        flush=True,
                    )
    ray.shutdown()


if __name__ == "__main__":
    main()
