"""rlray's default job against TRL's GRPOTrainer, side by side, one run after another.

    python benchmarks/vs_trl.py learning                      # held-out accuracy vs time
    python benchmarks/vs_trl.py learning --seeds 0 1 2        # tune on seed 0, then 3 seeds
    python benchmarks/vs_trl.py learning --trl-lrs 2e-5 --rlray-lrs 5e-5  # no tuning
    python benchmarks/vs_trl.py published --budget-s 1800 --rlray-steps 45 --trl-lrs 1e-5 2e-5 \
        --rlray-lrs 1e-5 2e-5 --seeds 0 1 2                  # SmolLM2 on a reasoning-gym task
    python benchmarks/vs_trl.py throughput                    # random-weight models, no accuracy
    python benchmarks/vs_trl.py throughput --sizes 0.5M 10M --lengths 64
    python benchmarks/vs_trl.py throughput --colocated        # also ray.placement colocated

TRL runs in a virtualenv of its own (TRL_VERSION and this torch's version, created on first
use under rlray's cache folder); it is never a dependency of rlray. Both sides read the
same numbers from rlray's default Config: model, prompts in the same order, the 200
held-out prompts, episodes per step, group size, mini-batches and epochs (4 optimizer
updates per step), completion length, temperature, fp32 on the CPU.

`learning`: each side trains for --budget-s seconds of training (held-out evaluations are
timed and subtracted on both sides) at each learning rate given, on the first seed; the
best learning rate of each side (highest mean held-out accuracy over the budget) then
runs on every seed, and the two are compared: seconds to 0.50 / 0.60 / 0.65, accuracy
at fixed training times, episodes/s and peak memory (PSS of all the run's processes,
shared pages counted once), with the ratios of the means.

`published`: the same on examples/smollm2-arithmetic.yaml, the published model
(SmolLM2-135M-Instruct, one folder for both sides) on a reasoning-gym task: its chat
prompts in order, its held-out rows, its reward (the task's own scorer, installed in
TRL's virtualenv too), its step shape. Held-out accuracy is the share of greedy replies
that the scorer gives 1. It prints seconds to the best held-out accuracy TRL reaches,
accuracy at equal training times, episodes/s, peak memory and where each side's time
went (rlray's driver phases; TRL's generating and scoring, and the rest of its steps).

`throughput`: random-weight Qwen2 models of the embedded model's shape family at about
0.5M, 10M and 100M parameters, every completion exactly --lengths tokens (end-of-sequence
masked until then), one optimizer update per step; rlray with 1 and 2 rollout workers
against TRL. The first step is warm-up and is not counted. rlray's learner splits each
step into micro-batches of at most 64 episodes and, with --micro-batch-tokens N, N tokens
(learner.micro_batch_tokens; without it the size's own in SIZES, else the job's
default): on the CPU a micro-batch of a few thousand tokens trains faster than one of 64
long episodes (benchmarks/micro_batches.py).

Runs whose result exists under --out are read, not re-run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from plots import accuracy_curves, throughput_by_size  # noqa: E402

from rlray.config import Config  # noqa: E402
from rlray.config.command_line import parse_command_line  # noqa: E402
from rlray.data.cache import cache_dir  # noqa: E402
from rlray.data.models import resolve_model_path  # noqa: E402
from rlray.data.prompts import eval_rows, train_prompts  # noqa: E402
from rlray.data.tiny_models import random_char_model  # noqa: E402
from rlray.observe.memory import GIB, total_pss_bytes  # noqa: E402

TRL_VERSION = "1.16.0"
PUBLISHED_JOB = REPO / "examples" / "smollm2-arithmetic.yaml"
WALL_TIMES = (25, 50, 100, 150, 200)
THRESHOLDS = (0.5, 0.6, 0.65)
# name: (hidden, layers, episodes per step, learner.micro_batch_tokens or None for the
# job's default); heads of head_dim 64, MLP 4x hidden, the 20-token character
# vocabulary. Fewer episodes per step as models grow, so that a step of the largest stays
# short enough to time several of on a CPU; its micro-batches hold 4 episodes of 272
# tokens, so that one step's activations stay within the learner's share of memory.
SIZES = {"0.5M": (128, 2, 256, None), "10M": (256, 12, 64, None), "100M": (768, 14, 16, 1100)}


# --- TRL's virtualenv ---------------------------------------------------------------


def trl_python() -> Path:
    """Returns the python of TRL's virtualenv, creating it on first use: TRL_VERSION and
    the torch version rlray runs (pip takes a local torch wheel where there is one)."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    venv = cache_dir() / "venvs" / f"trl-{TRL_VERSION}-torch-{torch_version}"
    python = venv / "bin" / "python"
    imports = f"import trl, reasoning_gym; assert trl.__version__ == '{TRL_VERSION}'"
    check = [str(python), "-c", imports]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} (TRL {TRL_VERSION}, torch {torch_version}; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    install = ["-m", "pip", "install", "--quiet", f"torch=={torch_version}", f"trl=={TRL_VERSION}"]
    # The published model's task is scored by reasoning-gym's own scorer on both sides.
    install.append(f"reasoning-gym=={importlib.metadata.version('reasoning-gym')}")
    done = subprocess.run([str(python), *install], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"installing TRL failed:\n{done.stderr[-3000:]}")
    return python


# --- running one side ---------------------------------------------------------------


@dataclass
class Outcome:
    """One run: held-out evaluations (step, episodes, seconds, accuracy), training
    seconds and episodes over the counted steps, completion tokens, peak memory."""

    evals: list[dict]
    seconds: float
    episodes: int
    tokens: float
    peak_gib: float | None
    phases: dict[str, float] | None = None
    """Where the run's time went: rlray's phase_seconds (what the driver waited on), TRL's
    generation (generating and scoring batches) and update (the rest of its steps)."""

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def time_to(self, accuracy: float) -> float | None:
        return next((e["seconds"] for e in self.evals if e["accuracy"] >= accuracy), None)

    def mean_accuracy(self, seconds: float, since: float = 0.0) -> float | None:
        """The mean of the held-out evaluations from `since` to `seconds` of training."""
        seen = [e["accuracy"] for e in self.evals if since <= e["seconds"] <= seconds]
        return statistics.mean(seen) if seen else None

    def accuracy_at(self, seconds: float) -> float | None:
        seen = [e["accuracy"] for e in self.evals if e["seconds"] <= seconds]
        return seen[-1] if seen else None


def run_measured(command: list[str], log: Path) -> float | None:
    """Runs a command to its end, sampling the PSS of it and its children every second;
    returns the peak in GiB. Raises SystemExit with the log's tail if it fails."""
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                peak[0] = max(peak[0], total_pss_bytes([process.pid]) or 0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait(timeout=7200)
        done.set()
        sampler.join()
    if code != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed ({code}):\n{log.read_text()[-3000:]}")
    return peak[0] / GIB if peak[0] else None


def run_trl(spec: dict, out: Path) -> Outcome:
    """Runs TRL's GRPOTrainer on the spec (unless its result exists); returns the outcome."""
    result = out / "result.json"
    if not result.is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "spec.json").write_text(json.dumps(spec))
        command = [str(trl_python()), str(REPO / "benchmarks" / "trl_grpo.py")]
        started = time.perf_counter()
        peak = run_measured([*command, str(out / "spec.json"), str(result)], out / "log.txt")
        data = json.loads(result.read_text())
        data["peak_gib"] = peak
        result.write_text(json.dumps(data, indent=2))
        print(f"  trl {out.name}: {time.perf_counter() - started:.0f} s", flush=True)
    data = json.loads(result.read_text())
    steps, counted = data["steps"], data["steps"][1:]
    seconds = counted[-1]["seconds"] - steps[0]["seconds"] if counted else data["seconds"]
    episodes = len(counted) * spec["episodes_per_step"] if counted else data["episodes"]
    if spec["eval_every"]:  # learning: every step counts, from the start of training
        seconds, episodes = data["seconds"], data["episodes"]
    # Throughput runs mask end-of-sequence, so every completion has max_new_tokens.
    tokens = episodes * spec["max_new_tokens"] if spec["min_new_tokens"] else 0.0
    generation = data.get("generation_seconds")
    phases = None if generation is None else {
        "generation": generation, "update": data["seconds"] - generation
    }  # fmt: skip
    return Outcome(data["evals"], seconds, episodes, tokens, data["peak_gib"], phases)


def run_rlray(args: list[str], out: Path, learning: bool) -> Outcome:
    """Runs jobs/ppo.py with the arguments (unless its summary exists); returns the
    outcome, its clock being training time without held-out evaluations."""
    if not (out / "summary.json").is_file():
        command = [sys.executable, str(REPO / "jobs" / "ppo.py"), *args, "--run-dir", str(out)]
        out.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        run_measured(command, out.parent / f"{out.name}.log")
        print(f"  rlray {out.name}: {time.perf_counter() - started:.0f} s", flush=True)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals, paused, episodes, tokens, start = [], 0.0, 0, 0.0, 0.0
    for record in records:
        phases = record.get("phase_seconds", {})
        paused += phases.get("evaluation", 0.0) + (0.0 if learning else phases.get("checkpoint", 0))
        seconds = record["elapsed_seconds"] - paused
        if record["step"] == 1 and not learning:  # warm-up step: the clock starts after it
            start = seconds
        elif record["step"] >= 1:
            episodes += record["episodes"]
            tokens += record["episodes"] * record["completion_length_mean"]
        # Exact match where the run has it, else (chat replies) the greedy replies that
        # the eval reward scores 1, as TRL's side counts them.
        accuracy = record.get("eval_accuracy")
        if accuracy is None:
            accuracy = (record.get("eval") or {}).get("reward/greedy_accuracy")
        if accuracy is not None:
            evals.append({"step": record["step"], "seconds": seconds, "accuracy": accuracy})
    phases = summary["phase_seconds"]
    return Outcome(evals, seconds - start, episodes, tokens, summary["memory_peak_gib"], phases)


# --- learning -----------------------------------------------------------------------


def task_spec(config: Config, model_path: str, steps: int) -> dict:
    """The shape of the default job as numbers TRL's side reads."""
    prompts = train_prompts(config.data, config.seed)
    count = steps * config.rollout.prompts_per_batch
    rows = [prompts.row(i) for i in range(count)]
    reward = config.reward.functions[0].name
    return {
        "model_path": model_path,
        "reward": reward,
        "train": [{"prompt": r.prompt, **r.columns} for r in rows],
        "eval": [{"prompt": r.prompt, **r.columns} for r in eval_rows(config.data)],
        "seed": config.seed,
        "steps": steps,
        "episodes_per_step": config.learner.episodes_per_step,
        "group_size": config.rollout.samples_per_prompt,
        "minibatch_size": config.learner.minibatch_episodes,
        "epochs": config.learner.epochs,
        "max_new_tokens": config.rollout.max_new_tokens,
        "min_new_tokens": config.rollout.min_new_tokens,
        "temperature": config.rollout.temperature,
        "threads": 2,
        "eval_every": config.learner.eval_every,
        "budget_s": 0.0,
        "lr": 0.0,
    }


def best(outcomes: dict[float, Outcome], budget: float) -> float:
    """The learning rate with the highest mean held-out accuracy over the evaluations
    within the budget (less noisy than the first evaluation over a threshold, and it
    rewards learning early as well as ending high)."""
    return max(outcomes, key=lambda lr: outcomes[lr].mean_accuracy(budget))


def learning(args: argparse.Namespace) -> None:
    """Tunes each side's learning rate on the first seed, then runs both best ones on
    every seed and prints the comparison."""
    trl_runs, our_runs = tuned_runs(args, [], "rlray default job")
    print(comparison(our_runs, trl_runs))
    if args.plot:
        title = "The default task (0.53M model), 2 CPU cores, a line a seed"
        plot_curves(our_runs, trl_runs, args.plot, title)


def published(args: argparse.Namespace) -> None:
    """The same on the published model's example job (SmolLM2-135M-Instruct on a
    reasoning-gym task): the same model folder, prompts in order, reward and scorer,
    held-out rows and step shape on both sides."""
    trl_runs, our_runs = tuned_runs(args, ["--config", str(PUBLISHED_JOB)], "rlray, published")
    print(published_comparison(our_runs, trl_runs, args.budget_s))
    if args.plot:
        title = "SmolLM2-135M-Instruct on basic_arithmetic, 2 CPU cores, a line a seed"
        plot_curves(our_runs, trl_runs, args.plot, title, args.budget_s)


def plot_curves(
    ours: list[Outcome], trl: list[Outcome], path: Path, title: str, budget: float | None = None
) -> None:
    """Both sides' held-out accuracy against training seconds, a line a seed."""
    runs = {"rlray": [o.evals for o in ours], "TRL GRPOTrainer": [o.evals for o in trl]}
    accuracy_curves(runs, path, title, budget=budget)


def tuned_runs(
    args: argparse.Namespace, job: list[str], name: str
) -> tuple[list[Outcome], list[Outcome]]:
    """Runs each side at each of its learning rates on the first seed, then its best one
    on every seed; returns (TRL's runs, rlray's runs) over the seeds. `job`: the job's
    config arguments (the default job's without any); TRL reads the same config."""

    def trl(lr: float, seed: int) -> Outcome:
        config = parse_command_line([*job, "--seed", str(seed)]).config
        spec = task_spec(config, resolve_model_path(config.model.path), args.trl_steps)
        spec.update(lr=lr, budget_s=args.budget_s)
        return run_trl(spec, args.out / f"trl-lr{lr:g}-seed{seed}")

    def ours(lr: float, seed: int) -> Outcome:
        run = [*job, "--seed", str(seed), "--learner.lr", str(lr), *args.rlray_args]
        run += ["--learner.steps", str(args.rlray_steps)]
        return run_rlray(run, args.out / f"rlray-lr{lr:g}-seed{seed}", learning=True)

    first = args.seeds[0]
    trl_tuning = {lr: trl(lr, first) for lr in args.trl_lrs}
    our_tuning = {lr: ours(lr, first) for lr in args.rlray_lrs}
    print(tuning_table(f"TRL GRPOTrainer, seed {first}", trl_tuning, args.budget_s))
    print(tuning_table(f"{name}, seed {first}", our_tuning, args.budget_s))
    trl_lr, our_lr = best(trl_tuning, args.budget_s), best(our_tuning, args.budget_s)
    # The tuning seed's run at the best rate is that seed's run: not made twice.
    trl_runs = [trl_tuning[trl_lr] if s == first else trl(trl_lr, s) for s in args.seeds]
    our_runs = [our_tuning[our_lr] if s == first else ours(our_lr, s) for s in args.seeds]
    seeds = " ".join(map(str, args.seeds))
    print(
        f"\nBest learning rates: rlray {our_lr:g}, TRL {trl_lr:g}; seeds {seeds}, mean (min-max):"
    )
    return trl_runs, our_runs


def tuning_table(name: str, outcomes: dict[float, Outcome], budget: float) -> str:
    lines = [
        f"\n{name}, by learning rate:\n",
        "| lr | mean accuracy | to 0.60 (s) | to 0.65 (s) | at budget | episodes/s |",
        "|---|---|---|---|---|---|",
    ]
    for lr, o in outcomes.items():
        lines.append(
            f"| {lr:g} | {o.mean_accuracy(budget):.3f} | {fmt(o.time_to(0.6), 0)} "
            f"| {fmt(o.time_to(0.65), 0)} | {fmt(o.accuracy_at(budget))} "
            f"| {fmt(o.episodes_per_s, 0 if o.episodes_per_s >= 100 else 2)} |"
        )
    return "\n".join(lines)


Measure = tuple[str, Callable[[Outcome], float | None], int]


def measure_table(measures: list[Measure], ours: list[Outcome], trl: list[Outcome]) -> list[str]:
    """The Markdown rows of each measure (name, function, digits) on both sides' runs
    over seeds, with the ratio of the means."""
    lines = ["\n| | rlray | TRL | rlray / TRL |", "|---|---|---|---|"]
    for name, measure, digits in measures:
        a, b = [measure(o) for o in ours], [measure(o) for o in trl]
        lines.append(
            f"| {name} | {spread(a, digits)} | {spread(b, digits)} | {ratio(mean(a), mean(b))} |"
        )
    return lines


def comparison(ours: list[Outcome], trl: list[Outcome]) -> str:
    """The Markdown table of both sides' runs over seeds, and the ratios of the means."""
    measures: list[Measure] = [
        *[(f"seconds to {a:.2f}", lambda o, a=a: o.time_to(a), 0) for a in THRESHOLDS],
        *[(f"accuracy at {t} s", lambda o, t=t: o.accuracy_at(t), 3) for t in WALL_TIMES],
        # Issue 26's goal: the mean over the 50 s before 200 s.
        ("mean accuracy over 150-200 s", lambda o: o.mean_accuracy(200, since=150), 3),
        ("training seconds run", lambda o: o.seconds, 0),
        ("episodes/s", lambda o: o.episodes_per_s, 0),
        ("peak memory (GiB)", lambda o: o.peak_gib, 2),
    ]
    lines = measure_table(measures, ours, trl)
    shortest = min(o.seconds for o in [*ours, *trl])
    if shortest < max(WALL_TIMES):
        lines.append(
            f"\n(a run shorter than a time shows its last evaluation there; the shortest ran "
            f"{shortest:.0f} s)"
        )
    return "\n".join(lines)


def published_comparison(ours: list[Outcome], trl: list[Outcome], budget: float) -> str:
    """The published model's table: time to the best held-out accuracy TRL reaches (its
    mean over seeds of each run's best), accuracy at equal training times, episodes/s,
    peak memory, and where each side's time went."""
    target = statistics.mean(max(e["accuracy"] for e in o.evals) for o in trl)
    times = [round(budget * share) for share in (1 / 6, 1 / 3, 1 / 2, 2 / 3, 5 / 6, 1)]
    measures: list[Measure] = [
        ("held-out accuracy at the start", lambda o: o.evals[0]["accuracy"], 3),
        (f"seconds to TRL's best ({target:.3f})", lambda o: o.time_to(target), 0),
        *[(f"accuracy at {t} s", lambda o, t=t: o.accuracy_at(t), 3) for t in times],
        ("training seconds run", lambda o: o.seconds, 0),
        ("episodes/s", lambda o: o.episodes_per_s, 3),
        ("peak memory (GiB)", lambda o: o.peak_gib, 2),
    ]
    lines = measure_table(measures, ours, trl)
    lines.append("\nWhere the time went (seconds, mean over seeds):")
    for side, runs in (("rlray", ours), ("TRL", trl)):
        totals: dict[str, list[float]] = {}
        for o in runs:
            for phase, seconds in (o.phases or {}).items():
                totals.setdefault(phase, []).append(seconds)
        split = sorted(((statistics.mean(v), k) for k, v in totals.items() if k != "total"))
        lines.append(f"- {side}: " + ", ".join(f"{k} {v:.0f}" for v, k in reversed(split)))
    return "\n".join(lines)


def mean(values: list[float | None]) -> float | None:
    return None if None in values else statistics.mean(values)


def spread(values: list[float | None], digits: int) -> str:
    """'mean (min-max)' over seeds; 'k/n reached' where some never got there."""
    if None in values:
        reached = len([v for v in values if v is not None])
        return f"{reached}/{len(values)} reached" if len(values) > 1 else "not reached"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    low, high = min(values), max(values)
    return f"{statistics.mean(values):.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


# --- throughput ---------------------------------------------------------------------


def throughput(args: argparse.Namespace) -> None:
    lines = [
        "\n| model | completion tokens | episodes/step | system | episodes/s | tokens/s "
        "| vs TRL | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    points: dict[str, list[tuple[float, float]]] = {}
    for size in args.sizes:
        for length in args.lengths:
            model, params = random_model(size, length)
            episodes, micro_batch_tokens = SIZES[size][2:]
            results = {
                f"rlray, {n} rollout worker{'s' * (n > 1)}": throughput_rlray(
                    model, length, (episodes, micro_batch_tokens), n, args
                )
                for n in args.rollout_workers
            }
            if args.colocated:  # the learner and its engine in one process, taking turns
                results["rlray, colocated"] = throughput_rlray(
                    model, length, (episodes, micro_batch_tokens), 1, args, "colocated"
                )
            results["TRL"] = throughput_trl(model, length, episodes, args)
            for system, o in results.items():
                points.setdefault(f"{system}, {length} tokens", []).append(
                    (params, o.episodes_per_s)
                )
                lines.append(
                    f"| {size} ({params / 1e6:.1f}M) | {length} | {episodes} | {system} | "
                    f"{o.episodes_per_s:.2f} | {o.tokens_per_s:.0f} | "
                    f"{ratio(o.episodes_per_s, results['TRL'].episodes_per_s)} | "
                    f"{fmt(o.peak_gib, 2)} |"
                )
    print("\n".join(lines))
    if args.plot:
        title = "Random-weight models, every completion of its length, 2 CPU cores"
        throughput_by_size(points, args.plot, title)


def random_model(size: str, length: int) -> tuple[str, int]:
    """Returns the directory and parameter count of the random model of that size, with a
    context window for an arithmetic prompt and `length` completion tokens."""
    hidden, layers, _, _ = SIZES[size]
    positions = length + 16
    out = cache_dir() / "models" / f"random-qwen2-{size}-ctx{positions}"
    if not (out / "params.json").is_file():
        params = random_char_model(out, hidden=hidden, layers=layers, max_positions=positions)
        (out / "params.json").write_text(json.dumps({"parameters": params}))
    return str(out), json.loads((out / "params.json").read_text())["parameters"]


def throughput_shape(
    length: int, episodes: int, micro_batch_tokens: int | None, args: argparse.Namespace
) -> list[str]:
    """The job arguments of a throughput run: one update per step on every episode."""
    tokens = args.micro_batch_tokens or micro_batch_tokens
    budget = [] if tokens is None else ["--learner.micro_batch_tokens", str(tokens)]
    return [
        "--rollout.max_new_tokens", str(length),
        "--rollout.min_new_tokens", str(length),
        "--model.max_model_len", str(length + 16),
        "--rollout.prompts_per_batch", str(episodes // 4),
        "--learner.episodes_per_step", str(episodes),
        "--learner.minibatch_size", str(episodes),
        "--learner.micro_batch_size", str(min(episodes, 64)),
        *budget,
        "--learner.epochs", "1",
        "--learner.steps", str(args.throughput_steps),
        "--learner.eval_every", "1000000",
        "--learner.checkpoint_every", "1000000",
        "--data.eval_size", "4",
    ]  # fmt: skip


def throughput_rlray(
    model: str,
    length: int,
    step: tuple[int, int | None],
    workers: int,
    args: argparse.Namespace,
    placement: str = "disaggregated",
) -> Outcome:
    job = ["--model.path", model, "--rollout.num_workers", str(workers), *args.rlray_args]
    job += ["--ray.placement", placement]
    name = f"rlray-{Path(model).name}-len{length}-workers{workers}"
    name += "-colocated" if placement == "colocated" else ""
    shape = throughput_shape(length, *step, args)
    return run_rlray([*job, *shape], args.out / name, learning=False)


def throughput_trl(model: str, length: int, episodes: int, args: argparse.Namespace) -> Outcome:
    config = Config()
    config.rollout.max_new_tokens = config.rollout.min_new_tokens = length
    config.rollout.prompts_per_batch = episodes // 4
    config.learner.episodes_per_step = config.learner.minibatch_size = episodes
    config.learner.epochs, config.learner.eval_every = 1, 0
    spec = task_spec(config, model, args.throughput_steps)
    spec.update(lr=config.learner.lr, budget_s=float("inf"))
    return run_trl(spec, args.out / f"trl-{Path(model).name}-len{length}")


# --- formatting and command line ------------------------------------------------------


def fmt(value: float | None, digits: int = 3) -> str:
    return "not reached" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["learning", "published", "throughput"])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-vs-trl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="first one tunes")
    parser.add_argument("--budget-s", type=float, default=200.0, help="training seconds")
    trl_lrs = [1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4]
    parser.add_argument("--trl-lrs", type=float, nargs="+", default=trl_lrs)
    parser.add_argument("--trl-steps", type=int, default=1000, help="step limit (budget first)")
    parser.add_argument("--rlray-lrs", type=float, nargs="+", default=[1e-5, 2e-5, 5e-5, 1e-4])
    parser.add_argument("--rlray-steps", type=int, default=350, help="steps of the rlray run")
    parser.add_argument(
        "--rlray-args", type=shlex.split, default=[], help="more job arguments, one string"
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rollout-workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="also run rlray colocated (ray.placement colocated: one process, taking turns)",
    )
    parser.add_argument("--throughput-steps", type=int, default=3)
    parser.add_argument(
        "--micro-batch-tokens", type=int, help="learner.micro_batch_tokens (default: the job's)"
    )
    parser.add_argument("--plot", type=Path, help="draw the comparison here (PNG)")
    args = parser.parse_args()
    {"learning": learning, "published": published, "throughput": throughput}[args.mode](args)


if __name__ == "__main__":
    main()
