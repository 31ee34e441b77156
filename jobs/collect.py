"""Collect episodes without training: rollout and reward actors with a fixed model over a
prompt set, every scored episode written to the episode store.

    python jobs/collect.py --prompts 512                       # built-in task, tiny model
    python jobs/collect.py --model path/to/model --data.train prompts.jsonl   # one pass
    python jobs/collect.py --prompts 1000 --store.path s3://bucket/datasets/run1

Takes the same config fields as jobs/ppo.py (the ppo, learner and buffer ones are
ignored). For datasets, baselines and evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray

from rlray.actors import ActorFailure, Actors, connect, start_actors, wait_for
from rlray.config import ConfigError, parse_command_line, validate
from rlray.data import FilePrompts
from rlray.driver import RunPlan, plan_run, write_config


def main(argv: list[str]) -> int:
    # 1. Config, checked before any actor starts.
    try:
        prompt_count, rest = parse_prompt_count(argv)
        command = parse_command_line(rest)
        validate(command.config)
        plan = plan_run(command.config, resume_dir=None)
        prompt_count = prompt_count or one_pass(plan)
    except ConfigError as err:
        print(f"collect.py: error: {err}", file=sys.stderr)
        return 2
    write_config(plan)
    config = plan.config

    # 2. Rollout, reward and store actors; no buffer, no learner.
    cpus = config.rollout.num_workers * config.rollout.cpus_per_worker
    connect(config.ray.address, max(config.ray.num_cpus, int(cpus + 1)))
    print(f"run directory: {plan.run_dir}", flush=True)
    try:
        actors = start_actors(config, plan.model_path, plan.run_id, train=False)
    except ActorFailure as err:
        print(f"collect.py: error: {err}", file=sys.stderr)
        return 1

    # 3. Generate, score and store every prompt's samples.
    try:
        summary = collect(plan, actors, prompt_count)
    except ActorFailure as err:
        print(f"collect.py: error: {err}", file=sys.stderr)
        return 1
    finally:
        stats, spooled = wait_for(
            actors.store.close.remote(),
            "store",
            "close",
            config.ray.call_timeout_s + config.store.upload_timeout_s,
        )
        actors.kill()
    if spooled:
        spool = Path(spooled[0]).parent
        print(
            f"warning: {len(spooled)} episode file(s) not uploaded; they wait in {spool}",
            file=sys.stderr,
        )
    summary["episodes_stored"] = stats.episodes_written
    (plan.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"done: {summary['episodes']} episodes of {prompt_count} prompts, reward mean "
        f"{summary['reward_mean']:.3f}, {summary['episodes_per_second']:.1f} episodes/s"
    )
    print(f"episodes: {summary['store']}")
    return 0


def parse_prompt_count(argv: list[str]) -> tuple[int | None, list[str]]:
    """Returns (--prompts N or None, the other arguments)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--prompts", type=int, default=None)
    known, rest = parser.parse_known_args(argv)
    if known.prompts is not None and known.prompts <= 0:
        raise ConfigError(f"--prompts must be > 0, got {known.prompts}")
    if "--help" in rest or "-h" in rest:
        print("collect.py --prompts N: how many prompts (default: one pass over data.train)")
    return known.prompts, rest


def one_pass(plan: RunPlan) -> int:
    """Returns the prompt count of one pass over a prompt file."""
    if isinstance(plan.prompts, FilePrompts):
        return len(plan.prompts.rows)
    raise ConfigError("--prompts: the built-in task has no end; say how many prompts to collect")


def collect(plan: RunPlan, actors: Actors, prompt_count: int) -> dict:
    """Keeps every rollout worker busy until `prompt_count` prompts are done; each scored
    batch goes from the reward actor to the store without passing through here."""
    config, timeout = plan.config, plan.config.ray.call_timeout_s
    per_batch, started = config.rollout.prompts_per_batch, time.perf_counter()
    cursor, in_flight, episodes, reward_sum = 0, {}, 0, 0.0
    while cursor < prompt_count or in_flight:
        idle = [w for w in range(len(actors.rollout)) if w not in in_flight.values()]
        for worker in idle:
            if cursor >= prompt_count:
                break
            rows = [
                plan.prompts.row(i) for i in range(cursor, min(cursor + per_batch, prompt_count))
            ]
            generated, _ = (
                actors.rollout[worker].generate.options(num_returns=2).remote(rows, cursor)
            )
            reward = actors.reward[worker % len(actors.reward)]
            scored, stats = reward.score.options(num_returns=2).remote(generated)
            in_flight[stats] = worker
            actors.store.append_batches.remote([[scored]], None, timeout)
            cursor += len(rows)
        ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=timeout)
        if not ready:
            raise ActorFailure(f"no rollout batch finished within {timeout:.0f} s")
        worker = in_flight.pop(ready[0])
        score = wait_for(
            ready[0], actors.reward_names[worker % len(actors.reward)], "score", timeout
        )
        episodes += score.episodes
        reward_sum += score.reward_sum
        print(f"collected {episodes} episodes", flush=True)
    wall = time.perf_counter() - started
    store = config.store.path or str(plan.run_dir / "episodes")
    return {
        "prompts": prompt_count,
        "episodes": episodes,
        "reward_mean": reward_sum / max(episodes, 1),
        "wall_seconds": wall,
        "episodes_per_second": episodes / wall,
        "store": store,
        "run_dir": str(plan.run_dir),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
