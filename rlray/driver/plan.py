"""The run plan: everything checked before any actor starts (model, prompts, rewards,
run directory), and the run directory's config.yaml; the same checks of the models
jobs/eval.py compares.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import yaml

from rlray.agent.traces import AGENT_ROLE_COLUMN
from rlray.algorithms.estimators import ESTIMATORS
from rlray.config import Config, ConfigError, config_to_dict, eval_rewards
from rlray.config.command_line import parse_command_line
from rlray.core.checkpoints import (
    checkpoint_problem,
    checkpoint_version,
    find_checkpoint,
    latest_checkpoint,
)
from rlray.core.episode import ModelLimits
from rlray.core.groups import AGENT_TRACE_COLUMN
from rlray.core.prompt import PromptRow
from rlray.data.models import model_limits, read_prompts, resolve_model_path
from rlray.data.prompts import (
    PromptSource,
    check_prompts_fit,
    eval_rows,
    lost_characters_warning,
    train_prompts,
)
from rlray.episodes.store import journal_name
from rlray.rewards.loading import absolute_spec_path, check_rewards
from rlray.rewards.worker import TRACE_COLUMN
from rlray.rollout.environments import load_environment

logger = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """Everything checked before any actor starts."""

    config: Config
    run_dir: Path
    run_id: str
    model_path: str
    prompts: PromptSource
    eval_rows: list[PromptRow]
    checkpoint: Path | None
    """Checkpoint to continue from (a resumed run), else None."""

    @property
    def first_step(self) -> int:
        """The first step this run logs: 0 (the evaluation before training) for a fresh
        start, else the step after the checkpoint's."""
        return checkpoint_version(self.checkpoint) + 1 if self.checkpoint else 0

    def resume_point(self) -> tuple[int, int]:
        """Returns (policy version, prompt cursor) to start from."""
        if self.checkpoint is None:
            return 0, 0
        state = json.loads((self.checkpoint / "state.json").read_text())
        return checkpoint_version(self.checkpoint), int(state["prompt_cursor"])

    def replay_prompts(self) -> list[int]:
        """Returns the prompts the checkpoint left handed out and not trained on, which a
        resumed run regenerates first (none for a fresh start, or a checkpoint from
        before they were recorded: its cursor was the lowest of them)."""
        if self.checkpoint is None:
            return []
        state = json.loads((self.checkpoint / "state.json").read_text())
        return [int(p) for p in state.get("replay_prompts", [])]

    def resumed(self) -> RunPlan:
        """Returns the plan continued from the run's latest checkpoint (after a lost actor)."""
        return replace(self, checkpoint=latest_checkpoint(self.run_dir))


def plan_run(config: Config, resume_dir: Path | None) -> RunPlan:
    """Returns the checked plan of a run, or raises ConfigError naming the bad input.

    Resolves the model (building the embedded one on first use), reads the prompts,
    checks that every prompt fits the context window and that reward functions load.
    The cheap checks (checkpoint, run directory) come first.
    """
    check_machine(config)
    if resume_dir is not None:
        check_resume_overrides(resume_dir, config)
    checkpoint = None if resume_dir is None else resume_checkpoint(resume_dir)
    run_dir = Path(config.run_dir or f"runs/ppo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    _check_writable(run_dir)
    _check_store_journals(run_dir, config.store.shards)
    prompts = train_prompts(config.data, config.seed)
    held_out = eval_rows(config.data)
    config.reward.functions = [absolute_spec_path(s, Path.cwd()) for s in config.reward.functions]
    config.eval.rewards = [absolute_spec_path(s, Path.cwd()) for s in config.eval.rewards]
    columns = {*prompts.row(0).columns, TRACE_COLUMN}
    if config.agent.enabled:  # agents' episodes name their trace and role too
        columns |= {AGENT_TRACE_COLUMN, AGENT_ROLE_COLUMN}
    check_rewards(config.reward.functions, columns)
    check_eval_rows(config, held_out)
    if config.rollout.environment:
        load_environment(config.rollout.environment)
    model_path = resolve_model_path(config.model.path)
    if config.rollout.backend != "simulated":  # a simulated engine reads no tokenizer
        _check_model_fits(config, model_path, prompts, held_out)
    config.run_dir = str(run_dir)
    return RunPlan(config, run_dir, run_dir.name, model_path, prompts, held_out, checkpoint)


def _check_model_fits(
    config: Config, model_path: str, prompts: PromptSource, held_out: list[PromptRow]
) -> None:
    """Raises ConfigError unless the model takes the run's stop tokens and every prompt
    fits its context window with its completion, read by the model's tokenizer."""
    limits = model_limits(model_path, config.model.max_model_len)
    _check_stop_token_ids(config.rollout.stop_token_ids, limits)
    sources = {"data.train": prompts.longest_prompts(), "data.eval": held_out}
    readings = read_prompts(model_path, [[r.prompt for r in rows] for rows in sources.values()])
    for (source, rows), read in zip(sources.items(), readings, strict=True):
        counts = [tokens.count for tokens in read]
        check_prompts_fit(
            rows, counts, config.completion_budget, config.model.max_model_len, source
        )
        if warning := lost_characters_warning(rows, [t.read_as for t in read], source):
            logger.warning("warning: %s", warning)


def check_machine(config: Config) -> None:
    """Raises ConfigError for what a new local Ray on this machine cannot run: more rollout
    or learner workers than it has cores (each runs an engine or a learner on one at
    least), a KV cache beyond its memory. Joining a cluster (ray.address, RAY_ADDRESS),
    its nodes decide. Simulated engines and learners (rollout.backend simulated) need no
    core of their own."""
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    if config.rollout.backend == "simulated":
        return
    cores = os.cpu_count() or 1
    for name, workers in (
        ("rollout.num_workers", config.rollout.num_workers),
        ("learner.num_workers", config.learner.num_workers),
    ):
        if workers > cores:
            raise ConfigError(
                f"{name} {workers}: this machine has {cores} CPU cores, one for each at "
                "least (more workers need a cluster: ray.address)"
            )
    rollout = config.rollout
    if rollout.kv_cache_gib and not rollout.gpus_per_worker:
        memory = psutil.virtual_memory().total / 2**30
        if rollout.kv_cache_gib * rollout.num_workers > memory:
            raise ConfigError(
                f"rollout.kv_cache_gib {rollout.kv_cache_gib}: {rollout.num_workers} rollout "
                f"worker(s) would hold {rollout.kv_cache_gib * rollout.num_workers} GiB of KV "
                f"cache; this machine has {memory:.1f} GiB of memory"
            )


# What a checkpoint holds that an override on --resume would change under it: the model it
# trained, its LoRA adapters, its critic (and the critic's optimizer state).
CHECKPOINTED = {
    "model.path": lambda c: c.model.path,
    "model.lora": lambda c: (
        (c.model.lora.rank, c.model.lora.alpha, sorted(c.model.lora.target_modules))
        if c.model.lora.rank
        else "off"
    ),
    "algorithm.advantage (a critic or none)": lambda c: (
        ESTIMATORS[c.algorithm.advantage].needs_critic
    ),
}


def check_resume_overrides(run_dir: Path, config: Config) -> None:
    """Raises ConfigError if an override changes what the run's checkpoints hold. Others
    continue the run as it would have gone (the KL reference is the run's starting model
    whatever kl_coef says, so turning KL on or off is one of them; the optimizer state is
    saved so that a learner group of another size loads it)."""
    before = parse_command_line(["--config", str(run_dir / "config.yaml")]).config
    for name, held in CHECKPOINTED.items():
        if held(before) != held(config):
            raise ConfigError(
                f"--resume: {name} was {held(before)} in {run_dir}/config.yaml, not "
                f"{held(config)}: its checkpoints hold what the run trained; start a new run"
            )


def _check_store_journals(run_dir: Path, shards: int) -> None:
    """Raises ConfigError if a store shard the run would not start has a journal in the
    run directory holding episodes it had not written: no store would write them."""
    for shard in itertools.count(shards):
        journal = run_dir / journal_name(shard)
        if not journal.is_dir():
            return
        if any(journal.glob("*.arrow")):
            raise ConfigError(
                f"store.shards: {journal} holds episodes store shard {shard} had not written; "
                f"run with store.shards {shard + 1} or more"
            )


def resume_checkpoint(run_dir: Path) -> Path:
    """Returns the run's newest checkpoint that verifies, warning of each newer one it
    skipped; raises ConfigError when none verifies."""
    search = find_checkpoint(run_dir)
    if search.checkpoint is None:
        found = f": {'; '.join(search.skipped)}" if search.skipped else ""
        raise ConfigError(f"--resume: no complete checkpoint under {run_dir}/checkpoints{found}")
    for line in search.skipped:
        logger.warning("warning: --resume skipped checkpoint %s", line)
    return search.checkpoint


def check_eval_rows(config: Config, rows: list[PromptRow]) -> None:
    """Raises ConfigError unless there are at least 2 held-out prompts (a standard error
    needs 2) and the eval rewards can score them (the columns they need)."""
    if len(rows) < 2:
        raise ConfigError(
            f"data.eval: {len(rows)} held-out prompt(s); an evaluation needs at least 2"
        )
    field = "eval.rewards" if config.eval.rewards else "reward.functions"
    columns = set.intersection(*(set(r.columns) for r in rows))
    check_rewards(eval_rewards(config), {*columns, TRACE_COLUMN}, field, "data.eval")


def model_directory(model: str) -> str:
    """Returns the model directory (or hub name) of a model argument (jobs/eval.py's): a
    checkpoint's policy, a run directory's latest checkpoint's, or model.path's
    resolution. Raises ConfigError naming the argument."""
    path = Path(model)
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise ConfigError(f"{model}: a run directory without a complete checkpoint")
        path = latest
    if (path / "state.json").is_file() and (path / "policy").is_dir():
        if problem := checkpoint_problem(path):
            raise ConfigError(f"{model}: checkpoint does not verify: {problem}")
        return str((path / "policy").resolve())
    try:
        return resolve_model_path(model)
    except ConfigError as err:
        raise ConfigError(f"{model}: {str(err).removeprefix('model.path: ')}") from None


def check_model_fits(config: Config, rows: list[PromptRow], path: str, model: str) -> None:
    """Raises ConfigError (naming the model) unless every held-out prompt fits with its
    completion in the context window, read by this model's tokenizer."""
    (read,) = read_prompts(path, [[r.prompt for r in rows]])
    try:
        check_prompts_fit(
            rows,
            [tokens.count for tokens in read],
            config.completion_budget,
            config.model.max_model_len,
            "data.eval",
        )
    except ConfigError as err:
        raise ConfigError(f"{model}: {err}") from None


def _check_stop_token_ids(token_ids: list[int], limits: ModelLimits | None) -> None:
    """Raises ConfigError if a stop token id is not in the model's vocabulary (a hub
    model's vocabulary is not known before vLLM loads it)."""
    for i, token in enumerate(token_ids):
        if limits is not None and token >= limits.vocab_size:
            raise ConfigError(
                f"rollout.stop_token_ids[{i}]: {token} is not a token id of the model "
                f"(vocabulary of {limits.vocab_size})"
            )


def _check_writable(run_dir: Path) -> None:
    """Raises ConfigError (run_dir) unless the run directory exists as a writable
    directory or can be created: its nearest existing parent is a writable directory."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run_dir: cannot create {run_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir: cannot write to {existing}")


def write_config(plan: RunPlan) -> None:
    """Creates the run directory, readable by its owner only (it holds checkpoints and
    every episode), and writes config.yaml, secrets left out (a resumed run keeps its
    own); raises ConfigError naming the path it cannot write."""
    create_run_directory(plan.run_dir)
    target = plan.run_dir / "config.yaml"
    if plan.checkpoint is None or not target.exists():
        text = yaml.safe_dump(config_to_dict(plan.config), sort_keys=False)
        try:
            target.touch(mode=0o600)
            target.write_text(text)
        except OSError as err:
            raise ConfigError(f"run_dir: cannot write {target}: {err.strerror}") from None


def create_run_directory(run_dir: Path) -> None:
    """Creates the run directory readable by its owner only (it holds checkpoints, every
    episode and the config); raises ConfigError naming the path it cannot make."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        run_dir.chmod(0o700)
    except OSError as err:
        raise ConfigError(
            f"run_dir: cannot create {err.filename or run_dir}: {err.strerror}"
        ) from None
