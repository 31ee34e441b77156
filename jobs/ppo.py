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
from rlray.checkpoints import BestCheckpoint, checkpoint_version, latest_checkpoint
from rlray.config import ConfigError, config_to_dict, parse_command_line, validate
from rlray.driver import (
    Evaluation,
    MetricsLog,
    RunPlan,
    TrainingDriver,
    plan_run,
    write_config,
)
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
        f"done: {summary['steps']} steps, {held_out_change(summary)}, "
        f"{summary['episodes_per_second']:.1f} episodes/s, {summary['wall_seconds']:.0f} s"
    )
    if best := summary["best_eval"]:
        where = best["checkpoint"] or f"the base model, {best['model']}"
        print(f"best: {best['metric']} {best['value']:.3f} at step {best['step']} ({where})")
    print(f"time: {describe_totals(summary['phase_seconds'])}")
    if summary["memory_peak_gib"] is not None:
        print(f"memory: peak {summary['memory_peak_gib']:.2f} GiB (PSS of the run's processes)")
    print(f"report: {picture}")
    print(f"run directory: {plan.run_dir}")


def held_out_change(summary: dict) -> str:
    """Returns how held-out exact match (or, without answers, the first eval metric)
    went from the first evaluation to the last."""
    if summary["initial_eval_accuracy"] is not None:
        first, last, name = (
            summary["initial_eval_accuracy"],
            summary["final_eval_accuracy"],
            "accuracy",
        )
    else:
        name = next(iter(summary["initial_eval"]))
        first, last = summary["initial_eval"][name], summary["final_eval"][name]
    return f"held-out {name} {first:.3f} -> {last:.3f}"


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
    metric = config.eval.best_metric
    best = BestCheckpoint(plan.run_dir, metric, before_step=first_step)
    if driver.learner_version == 0:
        initial = driver.evaluate()
        elapsed = time.perf_counter() - started
        log.write(
            {
                "step": 0,
                "policy_version": 0,
                **initial.record(),
                "elapsed_seconds": elapsed,
                "phase_seconds": driver.clock.lap(),
                "memory_gib": gib(memory.sample()),
            }
        )
        report_evaluation(progress, best, 0, initial, None, plan.model_path)
    episodes = 0
    for step in range(first_step, steps + 1):
        record = driver.train_step()
        episodes += record["episodes"]
        last = step == steps
        if step % config.learner.sync_every == 0 or last:
            record.update(driver.sync_weights())
        evaluation = None
        if step % config.learner.eval_every == 0 or last:
            evaluation = driver.evaluate()
            record.update(evaluation.record())
        # The best evaluation's policy is kept: checkpointed now if it would not be.
        better = evaluation is not None and best.improves(record["eval"])
        if step % config.learner.checkpoint_every == 0 or last or better:
            record["checkpoint"] = str(driver.save_checkpoint())
        if evaluation is not None:
            report_evaluation(
                progress, best, step, evaluation, record.get("checkpoint"), plan.model_path
            )
        record["elapsed_seconds"] = time.perf_counter() - started
        record["phase_seconds"] = driver.clock.lap()
        record["memory_gib"] = gib(memory.last_bytes)
        log.write(record)
        progress.stepped(record)
    wall = time.perf_counter() - started
    evals = [r for r in log.read() if "eval" in r]
    return {
        "initial_eval_accuracy": evals[0]["eval_accuracy"],
        "final_eval_accuracy": evals[-1]["eval_accuracy"],
        "initial_eval": evals[0]["eval"],
        "final_eval": evals[-1]["eval"],
        "best_eval": best.best,
        "steps": steps,
        "first_step_this_run": first_step,
        "episodes": episodes,
        "wall_seconds": wall,
        "episodes_per_second": episodes / wall,
        "phase_seconds": driver.clock.totals,
        "memory_peak_gib": gib(memory.peak_bytes),
        "run_dir": str(plan.run_dir),
    }


def report_evaluation(
    progress: Progress,
    best: BestCheckpoint,
    step: int,
    evaluation: Evaluation,
    checkpoint: str | None,
    model: str,
) -> None:
    """Prints an evaluation and records it in best.json if it is the best so far."""
    metrics = evaluation.summary.metrics
    shown = best.metric or next(iter(metrics))
    progress.evaluated(
        step, evaluation.result, (shown, metrics[shown].value, metrics[shown].stderr)
    )
    if best.improves({name: m.value for name, m in metrics.items()}):
        best.record(step, metrics[shown].value, metrics[shown].stderr, checkpoint, model)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
