"""RL fine-tuning of a causal LM (REINFORCE++, the GRPO family, PPO with a critic): vLLM
rollout actors, reward actors, a buffer, a learner.

    python jobs/ppo.py                      # embedded tiny model + arithmetic task
    python jobs/ppo.py --help               # every config field with its doc
    python jobs/ppo.py --algorithm.advantage rloo --learner.lr 1e-5 --run-dir runs/exp1
    python jobs/ppo.py --resume runs/exp1   # continue from the last checkpoint
    ray job submit --working-dir . -- python jobs/ppo.py   # the same on a cluster

Reads top to bottom: config -> checks -> actors -> loop -> report.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

# `python jobs/ppo.py` puts jobs/ on sys.path, not the repository; a cluster job's
# working directory is the repository, so this finds rlray without an install too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.actors import (
    ActorFailure,
    actor_processes,
    connect,
    local_pids,
    required_cpus,
    start_actors,
    start_ingest,
)
from rlray.checkpoints import checkpoint_version, latest_checkpoint
from rlray.config import ConfigError, config_to_dict, parse_command_line, validate
from rlray.driver import MetricsLog, RunPlan, TrainingDriver, plan_run, write_config
from rlray.memory import MemoryMonitor, gib
from rlray.progress import Progress
from rlray.report import write_report
from rlray.timing import describe_totals
from rlray.tracking import Trackers


def main(argv: list[str]) -> int:
    # 1. Config: defaults < --config file < command line; every check before any actor.
    try:
        command = parse_command_line(argv)
        validate(command.config)
        plan = plan_run(command.config, command.resume_dir)
    except ConfigError as err:
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 2
    write_config(plan)
    config = plan.config
    connect(config.ray.address, max(config.ray.num_cpus, int(required_cpus(config) + 0.999)))
    print(f"run directory: {plan.run_dir}", flush=True)

    # 2. Run; if an actor is lost for good (the learner, or a node), resume by itself.
    for restart in range(config.ray.max_job_restarts + 1):
        try:
            return run(plan)
        except RunLost as lost:
            if restart == config.ray.max_job_restarts:
                print(
                    f"ppo.py: error: {lost} (gave up after {restart} restarts: "
                    "ray.max_job_restarts)",
                    file=sys.stderr,
                )
                return 1
            plan = replace(plan, checkpoint=latest_checkpoint(plan.run_dir))
            start = plan.checkpoint.name if plan.checkpoint else "the start"
            print(f"ppo.py: {lost}; resuming from {start}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


class RunLost(Exception):
    """An actor died and Ray did not bring it back: the run resumes from its checkpoint."""


def run(plan: RunPlan) -> int:
    """Starts the actors, trains, reports; returns the exit code."""
    config = plan.config
    MetricsLog(plan.run_dir).keep_before(first_step(plan))
    try:
        actors = start_actors(
            config, plan.model_path, plan.run_id, plan.checkpoint and str(plan.checkpoint)
        )
    except ActorFailure as err:
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 1
    processes = actor_processes(actors, config.ray.call_timeout_s)
    (plan.run_dir / "placement.json").write_text(json.dumps(processes, indent=2))
    driver = TrainingDriver(plan, actors, *resume_point(plan))
    actor_pids = local_pids(processes)
    memory = MemoryMonitor(lambda: actor_pids).start()
    trackers = open_trackers(plan)
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # `ray job stop` stops like Ctrl-C
    summary = None
    try:
        if config.ingest.enabled:
            url = start_ingest(config, actors, plan.model_path, config.ray.actor_start_timeout_s)
            print(f"ingestion endpoint: {url}", flush=True)
        summary = train(plan, driver, memory, MetricsLog(plan.run_dir, trackers))
    except ActorFailure as err:
        if err.died:
            raise RunLost(str(err)) from err
        print(f"ppo.py: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "ppo.py: interrupted; every episode so far is kept, --resume continues "
            "from the last checkpoint",
            file=sys.stderr,
        )
        return 130
    finally:
        stored = driver.close_store()  # every scored episode written (or spooled)
        memory.stop()
        actors.kill()
        if summary is None:
            trackers.close()

    # 3. Report.
    summary["episodes_stored"] = stored.episodes_written if stored else None
    report(plan, summary, trackers)
    return 0


def report(plan: RunPlan, summary: dict, trackers: Trackers) -> None:
    """Writes summary.json and report.png, closes the trackers, prints the outcome."""
    (plan.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    trackers.summary(summary)
    trackers.close()
    picture = write_report(plan.run_dir)
    print(
        f"done: {summary['steps']} steps, held-out accuracy "
        f"{summary['initial_eval_accuracy']:.3f} -> {summary['final_eval_accuracy']:.3f}, "
        f"{summary['episodes_per_second']:.1f} episodes/s, {summary['wall_seconds']:.0f} s"
    )
    print(f"time: {describe_totals(summary['phase_seconds'])}")
    if summary["memory_peak_gib"] is not None:
        print(f"memory: peak {summary['memory_peak_gib']:.2f} GiB (PSS of the run's processes)")
    print(f"report: {picture}")
    print(f"run directory: {plan.run_dir}")


def open_trackers(plan: RunPlan) -> Trackers:
    """Returns the run's TensorBoard (always) and wandb (if configured) trackers."""
    tracking = plan.config.tracking
    return Trackers(
        plan.run_dir,
        config_to_dict(plan.config),
        plan.run_id,
        use_wandb=tracking.wandb,
        wandb_project=tracking.wandb_project,
        wandb_mode=tracking.wandb_mode or None,
    )


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def first_step(plan: RunPlan) -> int:
    """Returns the first step this run logs: 0 (the evaluation before training) for a
    fresh start, else the step after the checkpoint's."""
    return checkpoint_version(plan.checkpoint) + 1 if plan.checkpoint else 0


def resume_point(plan: RunPlan) -> tuple[int, int]:
    """Returns (policy version, prompt cursor) to start from."""
    if plan.checkpoint is None:
        return 0, 0
    state = json.loads((plan.checkpoint / "state.json").read_text())
    return checkpoint_version(plan.checkpoint), int(state["prompt_cursor"])


def train(plan: RunPlan, driver: TrainingDriver, memory: MemoryMonitor, log: MetricsLog) -> dict:
    """Runs learner steps up to learner.steps; returns the summary."""
    config = plan.config
    steps, started = config.learner.steps, time.perf_counter()
    driver.clock.restart()  # the split covers the same wall time as the summary
    first_step = driver.learner_version + 1
    progress = Progress(total_steps=steps, first_step=first_step)
    # Rollout workers start from the base model: give them the learner's weights (the
    # checkpoint's, in a resumed run) before anything is generated.
    driver.sync_weights()
    if driver.learner_version == 0:
        initial = driver.evaluate()
        elapsed = time.perf_counter() - started
        log.write(
            {
                "step": 0,
                "policy_version": 0,
                "eval_accuracy": initial.accuracy,
                "elapsed_seconds": elapsed,
                "phase_seconds": driver.clock.lap(),
                "memory_gib": gib(memory.sample()),
            }
        )
        progress.evaluated(0, initial)
    episodes = 0
    for step in range(first_step, steps + 1):
        record = driver.train_step()
        episodes += record["episodes"]
        last = step == steps
        if step % config.learner.sync_every == 0 or last:
            record.update(driver.sync_weights())
        if step % config.learner.eval_every == 0 or last:
            result = driver.evaluate()
            record.update(eval_accuracy=result.accuracy, eval_policy_version=result.policy_version)
            progress.evaluated(step, result)
        if step % config.learner.checkpoint_every == 0 or last:
            record["checkpoint"] = str(driver.save_checkpoint())
        record["elapsed_seconds"] = time.perf_counter() - started
        record["phase_seconds"] = driver.clock.lap()
        record["memory_gib"] = gib(memory.last_bytes)
        log.write(record)
        progress.stepped(record)
    wall = time.perf_counter() - started
    evals = [r["eval_accuracy"] for r in log.read() if r.get("eval_accuracy") is not None]
    return {
        "initial_eval_accuracy": evals[0],
        "final_eval_accuracy": evals[-1],
        "steps": steps,
        "first_step_this_run": first_step,
        "episodes": episodes,
        "wall_seconds": wall,
        "episodes_per_second": episodes / wall,
        "phase_seconds": driver.clock.totals,
        "memory_peak_gib": gib(memory.peak_bytes),
        "run_dir": str(plan.run_dir),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
