"""The one typed config: dataclasses with a docstring per field, YAML + command line.

`python jobs/ppo.py --help` prints every field below with its docstring; a YAML file
(`--config`) uses the same nesting (`algorithm: {advantage: grpo}`) and any field can be set on the
command line as `--algorithm.clip_high 0.28`. Cross-field rules live in `validate`, which names the
bad field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

BUILTIN_MODEL = "builtin:tiny-arithmetic"
BUILTIN_DATA = "builtin:arithmetic"

# Every set of choices is defined once, here; --help lists them and parsing checks them.
Dtype = Literal["float32", "bfloat16", "float16"]
PlacementStrategy = Literal["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"]
OnFailure = Literal["skip_component", "drop_episode"]
Interpolation = Literal["linear", "step"]
WandbMode = Literal["", "online", "offline", "disabled"]
Advantage = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
KLEstimator = Literal["k1", "k2", "k3"]
KLMode = Literal["reward", "loss"]
RolloutCorrection = Literal["token", "sequence", "off"]


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field or file."""


@dataclass
class ModelConfig:
    path: str = BUILTIN_MODEL
    """Local HF-format causal-LM directory that vLLM supports, a hub name (on machines
    that reach a hub), or builtin:tiny-arithmetic: a 0.53M-parameter Qwen2 built offline
    and warm-started on the arithmetic task on first use, then cached."""
    dtype: Dtype = "float32"
    """Weights dtype for rollouts and the learner: float32, bfloat16 or float16."""
    max_model_len: int = 64
    """Context window in tokens (prompt + completion) given to vLLM."""


@dataclass
class DataConfig:
    train: str = BUILTIN_DATA
    """Training prompts: builtin:arithmetic, or a JSONL file with a "prompt" field per
    line; other fields (e.g. "answer") reach the reward functions as columns."""
    eval: str = BUILTIN_DATA
    """Held-out prompts for greedy exact-match evaluation: builtin:arithmetic (pairs
    disjoint from training) or a JSONL file with "prompt" and "answer" fields."""
    eval_size: int = 200
    """How many held-out prompts each evaluation uses."""
    arithmetic_digits: int = 2
    """Operand digits of the built-in arithmetic task (a+b with a, b < 10**digits)."""
    shuffle: bool = True
    """Reshuffle training prompts every pass (seeded); false keeps file order."""


@dataclass
class RolloutConfig:
    num_workers: int = 1
    """Rollout actors, each with its own vLLM engine."""
    prompts_per_batch: int = 64
    """Prompts in one generate call; a rollout batch is prompts x samples episodes."""
    samples_per_prompt: int = 4
    """Completions sampled per prompt."""
    max_new_tokens: int = 6
    """Completion length limit in tokens."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores tokens at the same temperature)."""
    kv_cache_gib: int = 1
    """KV-cache size per worker in GiB (vLLM CPU backend; ignored on GPU)."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory a GPU rollout worker's vLLM engine may take."""
    enforce_eager: bool = True
    """Skip vLLM graph compilation (on CPU it costs ~20 s at start for no speed-up)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per rollout actor."""
    gpus_per_worker: float = 0.0
    """GPUs reserved per rollout actor (0 = vLLM CPU build)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per rollout actor, e.g. {rollout_node: 1} to keep rollouts on
    nodes started with `ray start --resources '{"rollout_node": 4}'`."""
    placement_strategy: PlacementStrategy = "SPREAD"
    """Placement group strategy of the rollout actors' bundles: SPREAD, STRICT_SPREAD
    (each on its own node), PACK or STRICT_PACK."""


@dataclass
class RewardSpec:
    name: str = "exact_match"
    """A built-in reward name (README lists them), or an import path to your own:
    "mypkg.rewards:fn" or "path/to/file.py:fn"."""
    weight: float = 1.0
    """Weight of this component in the total reward (used when there is no schedule)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the reward: passed on every call to a function, or once to
    a class's constructor (model-based rewards load their model there)."""
    schedule: list[list[float]] = field(default_factory=list)
    """Weight over training steps as [[step, weight], ...] points; empty keeps `weight`
    constant. Before the first point its weight holds, after the last the last's."""
    interpolation: Interpolation = "linear"
    """Between schedule points: linear (ramps) or step (each point's weight holds until
    the next point: piecewise constant)."""
    timeout_s: float = 60.0
    """Longest one call of this reward on a scoring batch; past it the component fails
    for that batch's episodes."""


@dataclass
class RewardConfig:
    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Reward components f(prompts, completions, **columns) -> list[float | None]; the
    total is their weighted sum. On the command line, a YAML list:
    '[{name: exact_match, weight: 1.0}]'."""
    on_failure: OnFailure = "skip_component"
    """When a component raises, times out or gives NaN/None for an episode:
    skip_component (total from the other components) or drop_episode (not trained on).
    Either way it is counted and the first error of each reward is logged once."""
    batch_size: int = 64
    """Episodes per call of a reward function (a rollout batch is scored in such pieces)."""
    num_workers: int = 1
    """Reward-scoring actors; rollout batches go to them in turn."""
    cpus_per_worker: float = 0.5
    """CPUs reserved per reward actor."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per reward actor."""
    placement_strategy: PlacementStrategy = "PACK"
    """Placement group strategy of the reward actors' bundles."""


@dataclass
class BufferConfig:
    capacity_episodes: int = 1024
    """Most episodes the buffer holds; producers wait while it is full."""
    max_staleness: int = 0
    """Drop episodes made by a policy more than this many learner updates behind the
    learner. 0 is strict on-policy PPO; >= 1 lets generation overlap training."""


@dataclass
class AlgorithmConfig:
    advantage: Advantage = "gae"
    """Advantage estimator: gae (PPO with a critic), grpo (group mean and std), dr_grpo
    (group mean only), rloo (leave-one-out group mean), reinforce_pp (discounted return,
    whitened over the batch) or reinforce_pp_baseline (group mean subtracted, then
    whitened over the batch). Only gae builds a critic; the group estimators compare the
    rollout.samples_per_prompt samples of each prompt."""
    policy_loss: PolicyLoss = "ppo"
    """Policy loss: ppo (token ratio clipped to [1 - clip_low, 1 + clip_high]), gspo
    (sequence-level ratio, the geometric mean of its token ratios, clipped) or cispo
    (REINFORCE weighted by the token ratio truncated to [1 - clip_low, 1 + clip_high],
    gradient through the logprob only)."""
    loss_aggregation: LossAggregation = "token_mean"
    """How token losses become the loss: token_mean (every token alike), seq_mean_token_mean
    (each sequence's token mean, averaged), seq_mean_token_sum (each sequence's token sum,
    averaged) or seq_mean_token_sum_norm (token sum / (sequences x max_new_tokens), as
    Dr. GRPO)."""
    clip_low: float | None = None
    """Lower clip offset of the ratio (1 - clip_low); none: the policy loss's own (ppo 0.2,
    gspo 3e-4, cispo 1.0 = no lower bound)."""
    clip_high: float | None = None
    """Upper clip offset of the ratio (1 + clip_high); none: the policy loss's own (ppo 0.2,
    gspo 4e-4, cispo 4.0). DAPO's clip-higher is ppo with clip_high 0.28."""
    gamma: float = 1.0
    """Discount factor of gae and reinforce_pp."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """gae only: normalise advantages to mean 0, std 1 over each step's tokens."""
    vf_coef: float = 0.5
    """Weight of the value loss (gae)."""
    value_clip: float = 0.2
    """Clip range of the value loss around the values before the update (gae)."""
    kl_coef: float = 0.05
    """Weight of the KL penalty against the frozen reference model; 0 holds no reference
    model."""
    kl_estimator: KLEstimator = "k1"
    """KL estimator: k1 (log ratio), k2 (half its square) or k3 (ratio - 1 - log ratio,
    always >= 0); http://joschu.net/blog/kl-approx.html."""
    kl_mode: KLMode = "reward"
    """Where the KL penalty goes: reward (per-token reward penalty) or loss (a loss term;
    needs k2 or k3: k1's gradient is zero in expectation)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (0 builds no entropy graph)."""
    drop_uniform_groups: bool = False
    """DAPO dynamic sampling: leave out groups whose samples all got the same reward (they
    teach a group estimator nothing) and generate more prompts to fill the step."""
    mask_truncated: bool = False
    """Leave completions cut off at rollout.max_new_tokens out of the loss."""
    rollout_correction: RolloutCorrection = "token"
    """Truncated importance sampling from vLLM's sampling policy to the learner's: token
    (a weight per token), sequence (one weight per completion) or off."""
    rollout_correction_clip: float = 2.0
    """Largest rollout-correction weight (truncation of pi_learner / pi_vllm)."""


@dataclass
class LearnerConfig:
    steps: int = 150
    """Learner steps (policy updates of one batch of episodes) in the run."""
    episodes_per_step: int = 256
    """Episodes in one learner step (a multiple of the rollout batch)."""
    epochs: int = 2
    """Passes over each step's episodes."""
    minibatch_size: int = 128
    """Episodes per optimizer update."""
    micro_batch_size: int = 64
    """Episodes per forward/backward; gradients accumulate over a mini-batch."""
    lr: float = 5e-5
    """AdamW learning rate of the policy."""
    critic_lr: float = 1e-4
    """AdamW learning rate of the critic (value model; algorithm.advantage gae)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory,
    about a third more compute)."""
    sync_every: int = 1
    """Publish weights to the rollout workers every this many learner steps."""
    eval_every: int = 10
    """Evaluate held-out accuracy every this many steps (and at step 0 and the end)."""
    checkpoint_every: int = 50
    """Save a checkpoint every this many steps (and at the end)."""
    cpus: float = 1.0
    """CPUs reserved for the learner actor."""
    gpus: float = 0.0
    """GPUs reserved for the learner actor (0 = train on CPU)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources for the learner, e.g. {learner_node: 1} to give it a node of
    its own."""


@dataclass
class StoreConfig:
    path: str = ""
    """Where every episode goes: empty for <run_dir>/episodes, a local directory, or
    s3://bucket/prefix (credentials from the standard AWS chain)."""
    s3_endpoint_url: str = ""
    """S3-compatible endpoint for an s3:// path (MinIO, moto); empty for AWS."""
    presigned_url_service: str = ""
    """Upload without credentials: an HTTP URL that answers GET <url>?key=<key> with a
    pre-signed PUT URL for that key. Used instead of `path`'s S3 upload when set."""
    rows_per_file: int = 2048
    """Episodes per Parquet file (files are written in batches, never one per episode)."""
    flush_every_s: float = 60.0
    """Write a file at least this often while episodes are buffered."""
    upload_timeout_s: float = 120.0
    """At the end of a run, how long to wait for uploads; files not uploaded by then stay
    in the local spool (a warning names it) and upload on a later run or by hand."""


@dataclass
class IngestConfig:
    enabled: bool = False
    """Serve POST /v1/episodes (and GET /v1/health) while the job runs."""
    host: str = "127.0.0.1"
    """Address to listen on. Anything but loopback needs a token."""
    port: int = 8321
    """Port to listen on."""
    token: str = ""
    """Bearer token clients must send; empty: the RLRAY_INGEST_TOKEN environment
    variable, and without either only loopback is served, unauthenticated."""
    max_body_bytes: int = 4_194_304
    """Largest request body; bigger ones get 413."""
    train: bool = False
    """Also queue posted episodes for training (off-policy data: they are trained on
    with the learner's own logprobs as the behaviour policy and never dropped as stale)."""


@dataclass
class TrackingConfig:
    wandb: bool = False
    """Also log config, per-step metrics, reward breakdown and summary to Weights &
    Biases (TensorBoard event files are always written under <run_dir>/tensorboard)."""
    wandb_project: str = "rlray"
    """wandb project name."""
    wandb_mode: WandbMode = ""
    """wandb mode: online, offline or disabled; empty leaves it to WANDB_MODE."""


@dataclass
class RayConfig:
    address: str = ""
    """Ray cluster to join. Empty: the cluster in RAY_ADDRESS (set by `ray job submit`)
    if any, else a new local single-node Ray."""
    num_cpus: int = 0
    """Logical CPUs of a new local Ray (0 = enough for the actors, at least this
    machine's cores)."""
    actor_start_timeout_s: float = 600.0
    """Longest wait for an actor to start (vLLM engine load included)."""
    call_timeout_s: float = 600.0
    """Longest wait for any one remote call (generate, score, learner step, sync)."""


@dataclass
class Config:
    run_dir: str = ""
    """Output directory; empty: runs/ppo-<date>-<time> under the working directory."""
    seed: int = 0
    """Seed of prompt order, sampling and learner initialisation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def rollout_batch_episodes(self) -> int:
        """Returns the number of episodes one generate call makes."""
        return self.rollout.prompts_per_batch * self.rollout.samples_per_prompt


# ---------------------------------------------------------------- field docs and types


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Returns {field name: docstring} from the string literal under each field."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_fields(cls: type = Config, prefix: str = "") -> dict[str, tuple[type, Any, str]]:
    """Returns {dotted name: (type, default, doc)} of every settable field."""
    out: dict[str, tuple[type, Any, str]] = {}
    docs, hints, defaults = field_docs(cls), _field_types(cls), cls()
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(leaf_fields(kind, f"{prefix}{f.name}."))  # type: ignore[arg-type]
        else:
            out[prefix + f.name] = (kind, getattr(defaults, f.name), docs.get(f.name, ""))
    return out


def _choices(choices: tuple[str, ...]) -> str:
    return ", ".join(repr(c) if c == "" else c for c in choices)


def _type_name(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin is Literal:
        return "{" + ",".join(typing.get_args(kind)) + "}"
    if origin is list:
        return "list"
    if origin is dict:
        return "mapping"
    return getattr(kind, "__name__", str(kind))


def coerce(value: Any, kind: Any, name: str) -> Any:
    """Returns `value` converted to `kind`, or raises ConfigError naming the field `name`."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(f"{name} must be one of {_choices(choices)}; got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if (value is None or value == "none") and type(None) in options:
            return None
        return coerce(value, next(t for t in options if t is not type(None)), name)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif kind is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, str):
            value = _parse_yaml_text(value, name)
        if isinstance(value, list):
            (item_kind,) = typing.get_args(kind)
            return [coerce(v, item_kind, f"{name}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, str):
            value = _parse_yaml_text(value, name)
        if isinstance(value, dict):
            return dict(value)
    elif dataclasses.is_dataclass(kind) and isinstance(value, dict):
        return build_dataclass(kind, value, name)  # type: ignore[arg-type]
    raise ConfigError(f"{name}: expected {_type_name(kind)}, got {value!r}")


def _parse_yaml_text(text: str, name: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{name}: not valid YAML: {' '.join(str(err).split())}") from None


def build_dataclass(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Returns `cls(**values)` with nested sections built and every value type-checked;
    an unknown key raises ConfigError that suggests the closest field."""
    hints = _field_types(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in known:
            guess = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" (did you mean '{prefix + '.' if prefix else ''}{guess[0]}'?)" if guess else ""
            raise ConfigError(f"unknown config field '{dotted}'{hint}")
        kind = hints[key]
        if dataclasses.is_dataclass(kind) and not isinstance(value, dict):
            raise ConfigError(f"{dotted}: expected a section of fields, got {value!r}")
        kwargs[key] = coerce(value, kind, dotted)
    return cls(**kwargs)


def config_to_dict(config: Config) -> dict[str, Any]:
    """Returns the config as nested plain dicts (what config.yaml holds)."""
    return dataclasses.asdict(config)


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Returns the mapping in a YAML config file, or raises ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of config sections, got {type(data).__name__}"
        )
    return data


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, leaf = dotted.split(".")
    for section in sections:
        node = tree.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{section}: expected a section of fields, got {node!r}")
        tree = node
    tree[leaf] = value


# ---------------------------------------------------------------- command line


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


@dataclass
class CommandLine:
    """What the command line asked for: the config and, if any, a run to resume."""

    config: Config
    resume_dir: Path | None


def build_parser(prog: str = "ppo.py") -> argparse.ArgumentParser:
    """Returns the argument parser whose --help lists every config field with its doc."""
    parser = _OneLineParser(
        prog=prog,
        description="PPO fine-tuning of a causal LM on Ray with vLLM rollouts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="Load config from a YAML file.")
    parser.add_argument(
        "--resume", metavar="RUN_DIR", help="Continue a stopped run from its last checkpoint."
    )
    parser.add_argument("--model", metavar="PATH", dest="model.path", help="Same as --model.path.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dotted, (kind, default, doc) in leaf_fields().items():
        section = dotted.split(".")[0] if "." in dotted else "run"
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} settings")
        shown = (
            default
            if not isinstance(default, list)
            else yaml.safe_dump(
                [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in default],
                default_flow_style=True,
            ).strip()
        )
        names = [f"--{dotted}"]
        if "_" in dotted:
            names.append(f"--{dotted.replace('_', '-')}")
        groups[section].add_argument(
            *names, dest=dotted, metavar=_type_name(kind).upper(), help=f"{doc} (default: {shown})"
        )
    return parser


def parse_command_line(argv: list[str]) -> CommandLine:
    """Returns the config from defaults < --config file (or the resumed run's
    config.yaml) < command-line overrides. Raises ConfigError on any bad input."""
    parser = build_parser()
    known, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        dotted = flag.lstrip("-").replace("-", "_")
        fields = list(leaf_fields())
        guess = difflib.get_close_matches(dotted, fields, n=1)
        hint = f" (did you mean '--{guess[0]}'?)" if guess else ""
        raise ConfigError(f"unknown config field '{flag}'{hint}")
    given = vars(known)
    resume_dir = Path(given.pop("resume")) if "resume" in given else None
    tree: dict[str, Any] = {}
    if resume_dir is not None:
        if "config" in given:
            raise ConfigError("--resume takes the run's own config.yaml; drop --config")
        if not (resume_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: no config.yaml in {resume_dir}")
        tree = load_yaml_file(resume_dir / "config.yaml")
        tree["run_dir"] = str(resume_dir)
    elif "config" in given:
        tree = load_yaml_file(given.pop("config"))
    given.pop("config", None)
    for dotted, value in given.items():
        _set_dotted(tree, dotted, value)
    if resume_dir is not None and Path(tree.get("run_dir", resume_dir)) != resume_dir:
        raise ConfigError("--resume and --run-dir name different directories")
    return CommandLine(config=build_dataclass(Config, tree), resume_dir=resume_dir)


# ---------------------------------------------------------------- validation


def validate(config: Config) -> None:
    """Raises ConfigError naming the first bad field; checks ranges and cross-field rules.

    File checks (model path, data files, prompt lengths) need the tokenizer and live in
    rlray.data.check_prompts_fit and rlray.models.resolve_model_path.
    """
    r, a, b, learner = config.rollout, config.algorithm, config.buffer, config.learner
    positive = {
        "model.max_model_len": config.model.max_model_len,
        "data.eval_size": config.data.eval_size,
        "data.arithmetic_digits": config.data.arithmetic_digits,
        "rollout.num_workers": r.num_workers,
        "rollout.prompts_per_batch": r.prompts_per_batch,
        "rollout.samples_per_prompt": r.samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.kv_cache_gib": r.kv_cache_gib,
        "reward.num_workers": config.reward.num_workers,
        "reward.batch_size": config.reward.batch_size,
        "buffer.capacity_episodes": b.capacity_episodes,
        "learner.episodes_per_step": learner.episodes_per_step,
        "learner.epochs": learner.epochs,
        "learner.minibatch_size": learner.minibatch_size,
        "learner.micro_batch_size": learner.micro_batch_size,
        "learner.lr": learner.lr,
        "learner.critic_lr": learner.critic_lr,
        "learner.max_grad_norm": learner.max_grad_norm,
        "learner.steps": learner.steps,
        "learner.sync_every": learner.sync_every,
        "learner.eval_every": learner.eval_every,
        "learner.checkpoint_every": learner.checkpoint_every,
        "algorithm.value_clip": a.value_clip,
        "algorithm.rollout_correction_clip": a.rollout_correction_clip,
        "ingest.port": config.ingest.port,
        "ingest.max_body_bytes": config.ingest.max_body_bytes,
        "store.rows_per_file": config.store.rows_per_file,
        "store.flush_every_s": config.store.flush_every_s,
        "store.upload_timeout_s": config.store.upload_timeout_s,
        "ray.actor_start_timeout_s": config.ray.actor_start_timeout_s,
        "ray.call_timeout_s": config.ray.call_timeout_s,
    }
    for name, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    non_negative = {
        "rollout.temperature": r.temperature,
        "rollout.cpus_per_worker": r.cpus_per_worker,
        "rollout.gpus_per_worker": r.gpus_per_worker,
        "reward.cpus_per_worker": config.reward.cpus_per_worker,
        "buffer.max_staleness": b.max_staleness,
        "algorithm.vf_coef": a.vf_coef,
        "algorithm.kl_coef": a.kl_coef,
        "algorithm.entropy_coef": a.entropy_coef,
        "learner.cpus": learner.cpus,
        "learner.gpus": learner.gpus,
        "ray.num_cpus": config.ray.num_cpus,
        "seed": config.seed,
    }
    for name, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    needs = {
        "rollout.cpus_per_worker": r.cpus_per_worker
        + r.gpus_per_worker
        + sum(r.resources.values()),
        "reward.cpus_per_worker": config.reward.cpus_per_worker
        + sum(config.reward.resources.values()),
        "learner.cpus": learner.cpus + learner.gpus + sum(learner.resources.values()),
    }
    for name, total in needs.items():
        if total <= 0:
            raise ConfigError(f"{name}: the actor must reserve some resource (CPU, GPU or custom)")
    for name, value in (("algorithm.gamma", a.gamma), ("algorithm.lam", a.lam)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value}")
    _check_algorithm(config)
    if r.temperature == 0:
        raise ConfigError("rollout.temperature must be > 0 (RL needs sampled episodes)")
    _check_batch_sizes(config)
    if b.max_staleness < learner.sync_every - 1:
        raise ConfigError(
            f"buffer.max_staleness ({b.max_staleness}) must be >= learner.sync_every - 1 "
            f"({learner.sync_every - 1}): rollouts lag that far between weight syncs"
        )
    _check_ingest(config.ingest)
    if not config.reward.functions:
        raise ConfigError("reward.functions must name at least one reward")
    for i, spec in enumerate(config.reward.functions):
        _check_reward_spec(f"reward.functions[{i}]", spec)


def _check_algorithm(config: Config) -> None:
    a = config.algorithm
    if a.kl_mode == "loss" and a.kl_estimator == "k1" and a.kl_coef > 0:
        raise ConfigError(
            "algorithm.kl_estimator k1 with kl_mode loss has zero gradient in expectation; "
            "use k2 or k3 (or kl_mode reward)"
        )
    for name in ("clip_low", "clip_high"):
        value = getattr(a, name)
        if value is not None and not value > 0:
            raise ConfigError(f"algorithm.{name} must be > 0, got {value}")
    if a.clip_low is not None and a.clip_low > 1 and a.policy_loss != "cispo":
        raise ConfigError(f"algorithm.clip_low must be <= 1 (a ratio is > 0), got {a.clip_low}")
    group = a.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
    if group and config.rollout.samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.samples_per_prompt must be >= 2 for algorithm.advantage {a.advantage} "
            "(it compares the samples of each prompt)"
        )


def _check_batch_sizes(config: Config) -> None:
    learner = config.learner
    if learner.episodes_per_step % config.rollout_batch_episodes:
        raise ConfigError(
            f"learner.episodes_per_step ({learner.episodes_per_step}) must be a multiple of the "
            f"rollout batch (rollout.prompts_per_batch x rollout.samples_per_prompt = "
            f"{config.rollout_batch_episodes})"
        )
    if learner.episodes_per_step % learner.minibatch_size:
        raise ConfigError(
            f"learner.minibatch_size ({learner.minibatch_size}) must divide "
            f"learner.episodes_per_step ({learner.episodes_per_step})"
        )
    if learner.minibatch_size % learner.micro_batch_size:
        raise ConfigError(
            f"learner.micro_batch_size ({learner.micro_batch_size}) must divide "
            f"learner.minibatch_size ({learner.minibatch_size})"
        )
    if config.buffer.capacity_episodes < learner.episodes_per_step:
        raise ConfigError(
            f"buffer.capacity_episodes ({config.buffer.capacity_episodes}) must hold one "
            f"learner step (learner.episodes_per_step = {learner.episodes_per_step})"
        )


def _check_ingest(ingest: IngestConfig) -> None:
    token = ingest.token or os.environ.get("RLRAY_INGEST_TOKEN", "")
    loopback = ingest.host in ("127.0.0.1", "::1", "localhost") or ingest.host.startswith("127.")
    if ingest.enabled and not token and not loopback:
        raise ConfigError(
            f"ingest.host: serving {ingest.host} needs a token (ingest.token or "
            "RLRAY_INGEST_TOKEN); without one only loopback (127.0.0.1) is served"
        )


def _check_reward_spec(name: str, spec: RewardSpec) -> None:
    if not spec.timeout_s > 0:
        raise ConfigError(f"{name}.timeout_s must be > 0, got {spec.timeout_s}")
    if any(len(point) != 2 for point in spec.schedule):
        raise ConfigError(
            f"{name}.schedule: each point must be [step, weight], got {spec.schedule}"
        )
    steps = [point[0] for point in spec.schedule]
    if steps != sorted(steps) or len(set(steps)) != len(steps) or any(s < 0 for s in steps):
        raise ConfigError(f"{name}.schedule: steps must be >= 0 and increasing, got {steps}")
