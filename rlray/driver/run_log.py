"""What a training run records as it goes, and its summary: a metrics.jsonl line per
step (also to TensorBoard and wandb), the console's progress, the best checkpoint by
eval.best_metric, the run's memory, and the wall time split into phases; at the end,
summary.json, report.png and the outcome in a few lines."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from rlray.cluster.start import Actors, actor_processes, local_pids
from rlray.config import config_to_dict
from rlray.driver.evaluation import BestCheckpoint, Evaluation
from rlray.driver.plan import RunPlan
from rlray.observe.memory import GIB, MemoryMonitor, gib
from rlray.observe.metrics_log import MetricsLog
from rlray.observe.progress import Progress
from rlray.observe.timing import PhaseClock, describe_totals
from rlray.observe.tracking import Trackers


@dataclass
class RunSummary:
    """What a training run did (summary.json)."""

    initial_eval_accuracy: float | None
    """Held-out exact match at the first evaluation (None without answers)."""
    final_eval_accuracy: float | None
    initial_eval: dict[str, float]
    """Every eval metric at the first evaluation, and at the last."""
    final_eval: dict[str, float]
    best_eval: dict[str, Any] | None
    """checkpoints/best.json: the best evaluation by eval.best_metric."""
    steps: int
    first_step_this_run: int
    episodes: int
    """Episodes trained on in this run (a resumed one counts from its first step)."""
    optimizer_updates: int
    """Optimizer updates in this run (each step's are in metrics.jsonl)."""
    wall_seconds: float
    episodes_per_second: float
    phase_seconds: dict[str, float]
    """Where the wall time went (rlray.observe.timing)."""
    memory_peak_gib: float | None
    """Peak PSS of the run's processes on the driver's node."""
    memory_peak_by_process_gib: dict[str, float]
    """At that peak, each process's PSS by name (actors by theirs; Ray's by its own)."""
    run_dir: str
    learner_padding_share: float | None = None
    """Of the token positions the learner computed in this run, the share that was
    padding (None before a step)."""
    learner_borrowed_share: float | None = None
    """Of them, the share computed with idle rollout cores lent to the learner
    (learner.borrow_idle_cores; None before a step)."""
    episodes_stored: int | None = None
    """Every scored episode the store wrote (None if it could not be closed)."""

    def held_out_change(self) -> str:
        """Returns how held-out exact match (or, without answers, the first eval metric)
        went from the first evaluation to the last."""
        if self.initial_eval_accuracy is not None:
            name, first, last = "accuracy", self.initial_eval_accuracy, self.final_eval_accuracy
        else:
            name = next(iter(self.initial_eval))
            first, last = self.initial_eval[name], self.final_eval[name]
        return f"held-out {name} {first:.3f} -> {last:.3f}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class RunLog:
    """The records of one training run (or of its resumed part)."""

    def __init__(self, plan: RunPlan, actors: Actors, clock: PhaseClock):
        config = plan.config
        self.plan = plan
        self.clock = clock
        self.first_step = max(plan.first_step, 1)
        """The first learner step of this run (step 0 is the evaluation before any)."""
        tracking = config.tracking
        self.trackers = Trackers(
            plan.run_dir,
            config_to_dict(config),
            plan.run_id,
            use_wandb=tracking.wandb,
            wandb_project=tracking.wandb_project,
            wandb_mode=tracking.wandb_mode or None,
        )
        self.metrics = MetricsLog(plan.run_dir, self.trackers)
        self.metrics.keep_before(plan.first_step)  # a resumed run logs its steps again
        # After the lines of steps to be made again are gone: whoever finds this run's
        # actors in placement.json finds its metrics.jsonl as this run goes on from.
        processes = actor_processes(actors, config.ray.call_timeout_s)
        (plan.run_dir / "placement.json").write_text(json.dumps(processes, indent=2))
        pids = local_pids(processes)
        names: dict[int, str] = {}
        for name, where in processes.items():  # a colocated actor is two roles' process
            if where["pid"] in pids:
                names[where["pid"]] = "+".join(filter(None, [names.get(where["pid"]), name]))
        self.memory = MemoryMonitor(lambda: pids, names=lambda: names).start()
        self.progress = Progress(total_steps=config.learner.steps, first_step=self.first_step)
        self.best = BestCheckpoint(plan.run_dir, config.eval.best_metric, self.first_step)
        self.episodes = 0
        self.optimizer_updates = 0
        self.learner_tokens = {"computed": 0, "padding": 0, "borrowed": 0}
        self.started = time.perf_counter()

    def start(self) -> None:
        """Starts the run's clock: the time split covers the summary's wall time."""
        self.started = time.perf_counter()
        self.clock.restart()

    def is_best(self, evaluation: Evaluation | None) -> bool:
        """Whether this evaluation beats the best so far (its policy is then checkpointed)."""
        return evaluation is not None and self.best.improves(_values(evaluation))

    def step(self, step: int, record: dict[str, Any], evaluation: Evaluation | None) -> None:
        """Writes step `step`'s metrics.jsonl line (the evaluation's too, if any), prints
        progress and keeps the best checkpoint's record."""
        self.timed(step, record)
        self.write(step, record, evaluation)

    def timed(self, step: int, record: dict[str, Any]) -> None:
        """Adds the step's time split, elapsed time and memory to its record, and counts
        its episodes: what `step` does first, done apart for a step whose evaluation
        comes after the next step's training."""
        self.episodes += record.get("episodes", 0)
        self.optimizer_updates += record.get("optimizer_updates", 0)
        self.learner_tokens["computed"] += record.get("learner_tokens_computed", 0)
        self.learner_tokens["padding"] += record.get("learner_padding_tokens", 0)
        self.learner_tokens["borrowed"] += record.get("learner_borrowed_tokens", 0)
        record["elapsed_seconds"] = time.perf_counter() - self.started
        record["phase_seconds"] = self.clock.lap()
        record["memory_gib"] = gib(self.memory.last_bytes if step else self.memory.sample())

    def write(self, step: int, record: dict[str, Any], evaluation: Evaluation | None) -> None:
        """Writes a timed record's metrics.jsonl line, with its evaluation if any."""
        if evaluation is not None:
            record.update(evaluation.record())
            self._evaluated(step, evaluation, record.get("checkpoint"))
        self.metrics.write(record)
        if step:
            self.progress.stepped(record)

    def _evaluated(self, step: int, evaluation: Evaluation, checkpoint: str | None) -> None:
        metrics = evaluation.summary.metrics
        shown = self.best.metric or next(iter(metrics), None)
        metric = None
        if shown in metrics:  # not where its reward failed on every completion
            metric = (shown, metrics[shown].value, metrics[shown].stderr)
        self.progress.evaluated(step, evaluation.result, metric)
        if metric is not None and self.best.improves(_values(evaluation)):
            self.best.record(step, metric[1], metric[2], checkpoint, self.plan.model_path)

    def summary(self) -> RunSummary:
        """Returns the run's summary (the evaluations are read back from metrics.jsonl,
        so a resumed run's first one is its first run's)."""
        wall = time.perf_counter() - self.started
        evals = [r for r in self.metrics.read() if "eval" in r]
        return RunSummary(
            initial_eval_accuracy=evals[0]["eval_accuracy"],
            final_eval_accuracy=evals[-1]["eval_accuracy"],
            initial_eval=evals[0]["eval"],
            final_eval=evals[-1]["eval"],
            best_eval=self.best.best,
            steps=self.plan.config.learner.steps,
            first_step_this_run=self.first_step,
            episodes=self.episodes,
            optimizer_updates=self.optimizer_updates,
            wall_seconds=wall,
            episodes_per_second=self.episodes / wall,
            phase_seconds=self.clock.totals,
            memory_peak_gib=gib(self.memory.peak_bytes),
            memory_peak_by_process_gib={
                name: size / GIB for name, size in self.memory.peak_by_process.items()
            },
            run_dir=str(self.plan.run_dir),
            learner_padding_share=self._learner_share("padding"),
            learner_borrowed_share=self._learner_share("borrowed"),
        )

    def _learner_share(self, kind: str) -> float | None:
        """Returns the share of the learner's computed token positions of this kind."""
        computed = self.learner_tokens["computed"]
        return self.learner_tokens[kind] / computed if computed else None

    def report(self, summary: RunSummary) -> None:
        """Writes summary.json and report.png, closes the trackers, prints the outcome."""
        run_dir = self.plan.run_dir
        (run_dir / "summary.json").write_text(summary.to_json())
        self.trackers.summary(summary.__dict__)
        self.trackers.close()
        # matplotlib loads once the actors are gone, out of the run's memory peak
        from rlray.observe.report import write_report

        picture = write_report(run_dir)
        print(
            f"done: {summary.steps} steps, {summary.held_out_change()}, "
            f"{summary.episodes_per_second:.1f} episodes/s, {summary.wall_seconds:.0f} s, "
            f"{summary.optimizer_updates} optimizer updates"
        )
        if best := summary.best_eval:
            where = best["checkpoint"] or f"the base model, {best['model']}"
            print(f"best: {best['metric']} {best['value']:.3f} at step {best['step']} ({where})")
        print(f"time: {describe_totals(summary.phase_seconds)}")
        if summary.memory_peak_gib is not None:
            largest = list(summary.memory_peak_by_process_gib.items())[:6]
            shares = ", ".join(f"{name} {size:.2f}" for name, size in largest)
            print(f"memory: peak {summary.memory_peak_gib:.2f} GiB (PSS: {shares}, ...)")
        print(f"report: {picture}")
        print(f"run directory: {run_dir}")

    def close(self) -> None:
        """Stops watching memory (the trackers close with the report, or at once if the
        run ends without one)."""
        self.memory.stop()


def _values(evaluation: Evaluation) -> dict[str, float]:
    return {name: metric.value for name, metric in evaluation.summary.metrics.items()}
