"""The one typed config: dataclasses with a docstring per field, YAML + command line.

`python jobs/ppo.py --help` prints every field below with its docstring; a YAML file
(`--config`) uses the same nesting (`algorithm: {advantage: grpo}`) and any field can be set on the
command line as `--algorithm.clip_high 0.28`. jsonargparse does the parsing and type checks;
`parse_command_line` adds --resume and turns its errors into one line. Ranges and cross-field
rules live in `validate`, which names the bad field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import math
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jsonargparse
import yaml
from jsonargparse import Namespace

from rlray.evaluation import metric_names

BUILTIN_MODEL = "builtin:tiny-arithmetic"
BUILTIN_DATA = "builtin:arithmetic"
# The multi-turn calculator task (rlray.calculator; examples/calculator.yaml).
BUILTIN_CALCULATOR_MODEL = "builtin:tiny-calculator"
BUILTIN_MULTIPLICATION = "builtin:multiplication"
BUILTIN_CALCULATOR = "builtin:calculator"

# Every set of choices is defined once, here; --help lists them and parsing checks them.
Dtype = Literal["float32", "bfloat16"]
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
WeightSync = Literal["auto", "object_store", "nccl", "gloo"]
KLMode = Literal["reward", "loss"]
PreferenceLoss = Literal["sigmoid", "ipo"]
RolloutCorrection = Literal["token", "sequence", "off"]


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field or file."""


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT): the learner trains low-rank adapters on the frozen base model
    and the rollout workers get the merged weights."""

    rank: int = 0
    """Adapter rank r; 0 (the default) trains every weight. With r > 0 only the adapters
    train (AdamW state for them alone); the KL reference is the same model with its
    adapters disabled, so no second copy is held. Adapter dropout is 0, like every other
    dropout: the ratio of two forward passes must not be noise."""
    alpha: float = 16.0
    """Adapter scale numerator: a layer computes W x + (alpha / rank) B A x."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj];
    [all-linear] is every linear layer but the output embedding."""


@dataclass
class ModelConfig:
    """The policy model: where its weights come from, their dtype, its context window."""

    path: str = BUILTIN_MODEL
    """Local HF-format causal-LM directory that vLLM supports, a hub name (on machines
    that reach a hub), or builtin:tiny-arithmetic: a 0.53M-parameter Qwen2 built offline
    and warm-started on the arithmetic task on first use, then cached
    (builtin:tiny-calculator: the same, warm-started on the calculator task)."""
    dtype: Dtype = "float32"
    """Compute dtype of rollouts and learner: float32, or bfloat16 (vLLM runs in bfloat16;
    the learner keeps float32 master weights and optimizer state and computes under
    bfloat16 autocast). float16 is not offered: training in it needs loss scaling, and
    bfloat16 has float32's range at the same cost."""
    max_model_len: int = 64
    """Context window in tokens (prompt + completion) given to vLLM."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters; off unless lora.rank > 0."""


@dataclass
class DataConfig:
    """Prompts: the training set and the held-out evaluation set."""

    train: str = BUILTIN_DATA
    """Training prompts: builtin:arithmetic, builtin:multiplication (two-digit a*b, the
    calculator task's), or a JSONL file with a "prompt" field per line; other fields
    (e.g. "answer") reach the reward functions as columns."""
    eval: str = BUILTIN_DATA
    """Held-out prompts for greedy evaluation: builtin:arithmetic or
    builtin:multiplication (pairs disjoint from training) or a JSONL file with "prompt"
    and "answer" fields. Scored by exact match, or with rollout.environment by the
    environment's reward."""
    eval_size: int = 200
    """How many held-out prompts each evaluation uses."""
    arithmetic_digits: int = 2
    """Operand digits of the built-in arithmetic task (a+b with a, b < 10**digits)."""
    shuffle: bool = True
    """Reshuffle training prompts every pass (seeded); false keeps file order."""


@dataclass
class RolloutConfig:
    """Rollout actors: vLLM engines that sample completions."""

    num_workers: int = 1
    """Rollout actors, each with its own vLLM engine."""
    prompts_per_batch: int = 64
    """Prompts in one generate call; a rollout batch is prompts x samples episodes."""
    samples_per_prompt: int = 4
    """Completions sampled per prompt."""
    max_new_tokens: int = 6
    """Completion length limit in tokens."""
    min_new_tokens: int = 0
    """Completions may not end (end-of-sequence is masked) before this many tokens, as in
    vLLM's min_tokens. The learner scores the unmasked policy, so the rollout-learner
    logprob gap grows; meant for throughput measurements with random-weight models."""
    temperature: float = 1.0
    """Sampling temperature (the learner scores tokens at the same temperature)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (vLLM's SamplingParams.stop), in generation and evaluation: a
    completion ends where one appears. Its text leaves the stop string out; its token ids
    keep every sampled token, so the learner trains on what was sampled."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides end-of-sequence (vLLM's
    SamplingParams.stop_token_ids), kept as its last token, e.g. a chat model's
    end-of-turn token where its config names another EOS."""
    kv_cache_gib: int = 0
    """KV-cache size per worker in GiB on vLLM's CPU backend; 0 sizes it to the job:
    every sequence of a rollout batch at model.max_model_len tokens. Ignored on GPU
    (see gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory a GPU rollout worker's vLLM engine may take."""
    enforce_eager: bool = True
    """Skip vLLM graph compilation (on CPU it costs ~20 s at start for no speed-up)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per rollout actor."""
    gpus_per_worker: float = 0.0
    """GPUs reserved per rollout actor (0 = vLLM CPU build)."""
    tensor_parallel_size: int = 1
    """GPUs one rollout worker's vLLM engine spans (tensor parallelism, through vLLM's
    Ray executor). Above 1 each rollout worker gets a placement group of its own, one
    GPU bundle per rank, all on one node (STRICT_PACK); gpus_per_worker must equal it."""
    weight_sync: WeightSync = "auto"
    """How the learner's weights reach the rollout workers after a step. object_store:
    the learner publishes them as one object that every worker loads (any devices; also
    what a restarted worker loads). nccl: vLLM's weight-transfer engine broadcasts them
    from the learner's GPU into every worker's engine, tensor by tensor. gloo: the same
    engine over a gloo group, on CPU. auto: nccl when the learner (learner.gpus) and the
    rollout workers (gpus_per_worker) have GPUs, else object_store."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per rollout actor, e.g. {rollout_node: 1} to keep rollouts on
    nodes started with `ray start --resources '{"rollout_node": 4}'`."""
    placement_strategy: PlacementStrategy = "SPREAD"
    """Placement group strategy of the rollout actors' bundles: SPREAD, STRICT_SPREAD
    (each on its own node), PACK or STRICT_PACK."""
    environment: str = ""
    """Multi-turn episodes: "" for one model call per episode; builtin:calculator (the
    calculator task), or your own class as "mypkg.envs:Env" or "path/to/file.py:Env",
    built once per trajectory: reset(row) -> str, step(text) -> a result with
    observation, reward and done (rlray.multiturn). Turns are token in, token out."""
    max_turns: int = 4
    """Model turns per multi-turn episode at most (with rollout.environment)."""
    max_completion_tokens: int = 0
    """Token budget of a multi-turn episode: every turn and observation together; 0 is
    max_new_tokens x max_turns. Prompt plus budget must fit model.max_model_len."""


@dataclass
class RewardSpec:
    """One reward component (an item of reward.functions)."""

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
    """Reward actors and the reward components they score with."""

    functions: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    """Reward components f(prompts, completions, **columns) -> list[float | None]; the
    total is their weighted sum. On the command line, a YAML list:
    '[{name: exact_match, weight: 1.0}]'; `--reward.functions.help RewardSpec` lists the
    fields of an item."""
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
    """The episode buffer between rollouts and the learner."""

    capacity_episodes: int = 1024
    """Most episodes the buffer holds; producers wait while it is full."""
    max_staleness: int = 1
    """Drop episodes made by a policy more than this many learner updates behind the
    learner. 0 is strictly on-policy; >= 1 lets generation overlap training, with the
    rollout correction weighing stale tokens. The default 1 trained the default job in
    30% less time to the same accuracy as 0 (3 seeds, BENCHMARKS.md)."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL and corrections."""

    advantage: Advantage = "reinforce_pp"
    """Advantage estimator: gae (PPO with a critic), grpo (group mean and std), dr_grpo
    (group mean only), rloo (leave-one-out group mean), reinforce_pp (discounted return,
    whitened over the batch) or reinforce_pp_baseline (group mean subtracted, then
    whitened over the batch). Only gae builds a critic; the group estimators compare the
    rollout.samples_per_prompt samples of each prompt. The default, reinforce_pp, learned
    fastest on the default task (BENCHMARKS.md)."""
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
    """Lower clip offset of the ratio (1 - clip_low); null: the policy loss's own (ppo 0.2,
    gspo 3e-4, cispo 1.0 = no lower bound)."""
    clip_high: float | None = None
    """Upper clip offset of the ratio (1 + clip_high); null: the policy loss's own (ppo 0.2,
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
    kl_coef: float = 0.0
    """Weight of the KL penalty against the frozen reference model; 0 (the default) holds
    no reference model."""
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
    """The learner actor: optimizer, batching, schedule of syncs, evals, checkpoints."""

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
    num_workers: int = 1
    """Learner actors: one process group (gloo on CPU, NCCL on GPU) over which the
    models, gradients and optimizer state are sharded with FSDP2, each learner taking
    its share of every batch's tokens. The run directory must be one every learner
    sees (each writes its shard of a checkpoint)."""
    cpus: float = 1.0
    """CPUs reserved for each learner actor."""
    gpus: float = 0.0
    """GPUs reserved for each learner actor (0 = train on CPU)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources for the learner, e.g. {learner_node: 1} to give it a node of
    its own."""


@dataclass
class EvalConfig:
    """Held-out evaluation, scored by the run's reward functions.

    At step 0, every learner.eval_every steps and at the end, each data.eval prompt's
    greedy completion and eval.samples sampled ones are scored by reward.functions (or
    eval.rewards); jobs/eval.py compares models the same way."""

    samples: int = 0
    """Sampled completions per held-out prompt besides the greedy one, at
    eval.temperature: the n of pass@k and mean@k (0: the greedy completion only)."""
    temperature: float = 1.0
    """Sampling temperature of those completions."""
    pass_k: list[int] = field(default_factory=lambda: [1])
    """The k of pass@k, each at most eval.samples (unused when samples is 0)."""
    pass_threshold: float = 1.0
    """Score at or above which a completion passes (greedy accuracy and pass@k)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward components to evaluate with, as reward.functions; empty: reward.functions."""
    best_metric: str = "reward/greedy_accuracy"
    """The metric that picks the best checkpoint (checkpoints/best.json): "reward" (the
    weighted total) or a component's name, then /greedy_accuracy, /mean or /pass@K;
    empty: no best checkpoint is kept."""


@dataclass
class PreferenceConfig:
    """Preference learning: DPO or IPO updates of the policy on pairs of completions
    (jobs/dpo.py), and reward models fit to the same pairs (jobs/reward_model.py).

    data.train holds the pairs (JSONL: prompt, chosen, rejected, as TRL's preference
    datasets), or builtin:arithmetic for built-in pairs (the correct sum chosen over a
    wrong one). jobs/dpo.py takes model.*, learner.lr, learner.steps,
    learner.micro_batch_size, learner.eval_every and learner.checkpoint_every as
    jobs/ppo.py does; jobs/reward_model.py takes model.path (the trunk),
    learner.micro_batch_size, learner.max_grad_norm and learner.eval_every, and its own
    rate and length below."""

    loss: PreferenceLoss = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2 over per-token mean
    logprobs (h: the policy's log-ratio margin of chosen over rejected, against the
    reference)."""
    beta: float = 0.1
    """Strength of the pull toward the reference model (DPO's beta, IPO's tau)."""
    label_smoothing: float = 0.0
    """Probability that a pair's label is wrong (conservative DPO), below 0.5; sigmoid
    loss only."""
    pairs_per_step: int = 64
    """Pairs in one update."""
    reward_model_lr: float = 1e-3
    """jobs/reward_model.py's peak learning rate (falling along a cosine to 1% of it):
    a fresh score head needs far more than a policy may take."""
    reward_model_steps: int = 5000
    """jobs/reward_model.py's updates, one batch of pairs_per_step pairs each."""
    reward_model_center: float = 0.01
    """Weight of the centring term of jobs/reward_model.py's loss, (r(chosen) +
    r(rejected))^2, that keeps scores around 0 for every prompt (TRL's
    center_rewards_coefficient); 0 for the Bradley-Terry loss alone."""
    eval_pairs: int = 64
    """Pairs held out of data.train (the first after a seeded shuffle; with
    builtin:arithmetic, pairs of the held-out prompts) for the held-out loss, margin and
    implicit-reward accuracy."""


@dataclass
class StoreConfig:
    """The episode store: every scored episode as Parquet, local or on S3."""

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
    """The HTTP endpoint that takes episodes made outside the job."""

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
    """Experiment tracking besides TensorBoard."""

    wandb: bool = False
    """Also log config, per-step metrics, reward breakdown and summary to Weights &
    Biases (TensorBoard event files are always written under <run_dir>/tensorboard)."""
    wandb_project: str = "rlray"
    """wandb project name."""
    wandb_mode: WandbMode = ""
    """wandb mode: online, offline or disabled; empty leaves it to WANDB_MODE."""


@dataclass
class RayConfig:
    """The Ray cluster and the timeouts of remote calls."""

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
    max_actor_restarts: int = 3
    """Times Ray restarts a dead rollout, reward, buffer or store actor; the batches it
    held are regenerated, re-scored or restored, never lost or trained on twice."""
    max_job_restarts: int = 2
    """Times the run resumes by itself from its last checkpoint after the learner (or
    its node) dies, before it fails naming the learner."""


@dataclass
class Config:
    """The one typed config of a run: run settings, then a section per part of the system."""

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
    eval: EvalConfig = field(default_factory=EvalConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def completion_budget(self) -> int:
        """Returns the most completion tokens an episode can have: max_new_tokens, or a
        multi-turn episode's budget (turns and observations)."""
        r = self.rollout
        if not r.environment:
            return r.max_new_tokens
        return r.max_completion_tokens or r.max_new_tokens * r.max_turns

    @property
    def rollout_batch_episodes(self) -> int:
        """Returns the number of episodes one generate call makes."""
        return self.rollout.prompts_per_batch * self.rollout.samples_per_prompt


# ---------------------------------------------------------------- command line

# jsonargparse builds the parser from the dataclasses above: their type hints, defaults and
# the string literal under each field (read by docstring-parser) as its --help text.
jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)

USAGE = (
    "%(prog)s [--config FILE.yaml | --resume RUN_DIR] [--model PATH] [--SECTION.FIELD VALUE ...]"
)
DESCRIPTION = """\
RL fine-tuning of a causal LM on Ray with vLLM rollouts.

Every field below can be set on the command line (--learner.lr 2e-5, or with dashes:
--learner.micro-batch-size 32) or in a YAML file of the same nesting (learner: {lr: 2e-5}).
Lists and mappings are YAML text: --reward.functions '[{name: exact_match, weight: 2.0}]'.
Precedence: defaults < --config file (or the resumed run's config.yaml) < command line."""


@dataclass
class CommandLine:
    """What the command line asked for: the config and, if any, a run to resume."""

    config: Config
    resume_dir: Path | None


def build_parser(prog: str | None = None) -> jsonargparse.ArgumentParser:
    """Returns the parser whose --help lists every config field with its doc, its default
    and, for Literal fields, the choices."""
    parser = jsonargparse.ArgumentParser(
        prog=prog,
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        exit_on_error=False,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="Load config from a YAML file; command-line fields override it.",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="Continue a stopped run from its last checkpoint, with its own config.yaml; "
        "command-line fields override it (e.g. --learner.steps 200 to run longer).",
    )
    parser.add_class_arguments(Config, as_group=False)
    # `--model PATH` is short for --model.path (parse_command_line rewrites it); the flag
    # jsonargparse made for it would load the model section from a file, which --config does.
    (shortcut,) = [action for action in parser._actions if action.option_strings == ["--model"]]
    shortcut.metavar, shortcut.help = "PATH", "Same as --model.path."
    return parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, jsonargparse.DefaultHelpFormatter):
    """Prints the description as written; wraps field docs without breaking at hyphens
    (so `builtin:tiny-arithmetic` stays whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def parse_command_line(argv: list[str]) -> CommandLine:
    """Returns the config from defaults < --config file (or the resumed run's
    config.yaml) < command-line overrides. Raises ConfigError on any bad input."""
    parser = build_parser()
    argv = [_canonical(arg) for arg in argv]
    given = _checked(parser.parse_args, argv)
    resume_dir = Path(given.resume) if given.resume else None
    tree = None
    if resume_dir is not None:
        if given.config:
            raise ConfigError("--resume takes the run's own config.yaml; drop --config")
        if not (resume_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: no config.yaml in {resume_dir}")
        tree = {**load_yaml_file(resume_dir / "config.yaml"), "run_dir": str(resume_dir)}
    elif given.config:
        tree = load_yaml_file(given.config)
    if tree is not None:  # the file's values, then the command line's on top
        given = _checked(parser.parse_args, argv, namespace=_checked(parser.parse_object, tree))
    for f in dataclasses.fields(Config):
        section = dataclasses.is_dataclass(_field_types(Config)[f.name])
        if section and not isinstance(given[f.name], Namespace):
            raise ConfigError(f"{f.name}: expected a section of fields, got {given[f.name]!r}")
    built = _checked(parser.instantiate, given)
    config = Config(**{f.name: built[f.name] for f in dataclasses.fields(Config)})
    if resume_dir is not None and Path(config.run_dir) != resume_dir:
        raise ConfigError("--resume and --run-dir name different directories")
    return CommandLine(config=config, resume_dir=resume_dir)


def _canonical(arg: str) -> str:
    """Returns a flag as the parser knows it: dashes in its name as underscores
    (--rollout.max-new-tokens is --rollout.max_new_tokens), --model as --model.path;
    values pass unchanged."""
    if not arg.startswith("--") or arg == "--":
        return arg
    flag, eq, value = arg.partition("=")
    flag = "--" + flag[2:].replace("-", "_")
    return ("--model.path" if flag == "--model" else flag) + eq + value


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


def config_to_dict(config: Config) -> dict[str, Any]:
    """Returns the config as nested plain dicts (what config.yaml holds)."""
    return dataclasses.asdict(config)


def _checked(parse: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Returns parse(*args, **kwargs); jsonargparse's errors become one-line ConfigErrors."""
    try:
        return parse(*args, **kwargs)
    except argparse.ArgumentError as err:
        raise ConfigError(_one_line(str(err))) from None


def _one_line(message: str) -> str:
    """Returns a jsonargparse error message as one line that names the field.

    jsonargparse nests its messages (`Parser key "reward.functions":` then the item's
    `Parser key "weight":` ...); the innermost line says what is wrong."""
    name = ""
    for key in re.findall(r'Parser key "([^"]+)"', message):  # outermost first
        name = key if not name or f"{key}.".startswith(f"{name}.") else f"{name}.{key}"
    if unknown := re.match(r"unrecognized arguments: (\S+)", message):
        flag = unknown[1].split("=")[0]
        flags = ["--" + key for key in build_parser().get_defaults().keys()]  # noqa: SIM118
        return f"unknown config field '{flag}'" + _did_you_mean(flag, [*flags, "--model"])
    if unknown := re.search(r"(?:Group '([^']+)' does not accept o|O)ption '([^']+)'", message):
        section = ".".join(filter(None, [name, unknown[1]]))
        dotted = ".".join(filter(None, [section, unknown[2]]))
        fields = [f"{section}.{f}" if section else f for f in _fields_under(section)]
        return f"unknown config field '{dotted}'" + _did_you_mean(dotted, fields)
    given = re.search(r"(?:Got|Given) value: (.*)", message)
    expected = re.search(r"Expected a (.*?)\. Got value:", message)
    if name and given and expected:
        value = given[1]
        if choices := re.match(r"typing\.Literal\[(.*)\]$", expected[1]):
            options = ast.literal_eval(f"({choices[1]},)")
            listed = ", ".join(repr(c) if c == "" else c for c in options)
            return f"{name} must be one of {listed}; got {value!r}"
        kind = _type_word(expected[1])
        if kind == "float" and _is_non_finite(value):
            return f"{name} must be finite, got {value}"
        return f"{name}: expected {kind}, got {value!r}"
    if name and (section := re.search(r"Unable to load config '([^']*)'", message)):
        return f"{name}: expected a section of fields, got {section[1]!r}"
    if name and given and (subtypes := re.search(r"Subtypes: \[(.*)\]", message)):
        kinds = " or ".join(_type_word(t) for t in subtypes[1].split(", "))
        return f"{name}: expected {kinds}, got {given[1]!r}"
    return " ".join(message.split())


def _type_word(kind: str) -> str:
    """Returns "float" for "<class 'float'>", "null" for NoneType."""
    word = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", kind)
    return {"NoneType": "null", "dict": "mapping"}.get(word, word)


def _is_non_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _did_you_mean(name: str, known: list[str]) -> str:
    guess = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


def _fields_under(section: str) -> list[str]:
    """Returns the field names of a section ("" for the top level, "reward.functions" for a
    reward spec)."""
    kind: Any = Config
    for part in filter(None, section.split(".")):
        kind = _field_types(kind).get(part) if dataclasses.is_dataclass(kind) else None
        if typing.get_origin(kind) is list:
            (kind,) = typing.get_args(kind)
    return [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---------------------------------------------------------------- validation


def validate(config: Config) -> None:
    """Raises ConfigError naming the first bad field; checks ranges and cross-field rules.

    File checks (model path, data files, prompt lengths) need the tokenizer and live in
    rlray.data.check_prompts_fit and rlray.models.resolve_model_path.
    """
    for name, value in _float_fields(config, Config):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be finite, got {value}")
    r, a, b, learner = config.rollout, config.algorithm, config.buffer, config.learner
    positive = {
        "model.max_model_len": config.model.max_model_len,
        "data.eval_size": config.data.eval_size,
        "data.arithmetic_digits": config.data.arithmetic_digits,
        "rollout.num_workers": r.num_workers,
        "rollout.prompts_per_batch": r.prompts_per_batch,
        "rollout.samples_per_prompt": r.samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.max_turns": r.max_turns,
        "rollout.tensor_parallel_size": r.tensor_parallel_size,
        "reward.num_workers": config.reward.num_workers,
        "reward.batch_size": config.reward.batch_size,
        "buffer.capacity_episodes": b.capacity_episodes,
        "learner.episodes_per_step": learner.episodes_per_step,
        "learner.num_workers": learner.num_workers,
        "preference.beta": config.preference.beta,
        "preference.pairs_per_step": config.preference.pairs_per_step,
        "preference.eval_pairs": config.preference.eval_pairs,
        "preference.reward_model_lr": config.preference.reward_model_lr,
        "preference.reward_model_steps": config.preference.reward_model_steps,
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
        "rollout.gpu_memory_utilization": r.gpu_memory_utilization,
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
        "rollout.kv_cache_gib": r.kv_cache_gib,
        "rollout.min_new_tokens": r.min_new_tokens,
        "rollout.max_completion_tokens": r.max_completion_tokens,
        "reward.cpus_per_worker": config.reward.cpus_per_worker,
        "buffer.max_staleness": b.max_staleness,
        "algorithm.vf_coef": a.vf_coef,
        "algorithm.kl_coef": a.kl_coef,
        "algorithm.entropy_coef": a.entropy_coef,
        "preference.reward_model_center": config.preference.reward_model_center,
        "learner.cpus": learner.cpus,
        "learner.gpus": learner.gpus,
        "ray.num_cpus": config.ray.num_cpus,
        "ray.max_actor_restarts": config.ray.max_actor_restarts,
        "ray.max_job_restarts": config.ray.max_job_restarts,
        "seed": config.seed,
    }
    for section in ("rollout", "reward", "learner"):
        for key, value in getattr(config, section).resources.items():
            non_negative[f"{section}.resources.{key}"] = value
    for name, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    _check_lora(config.model.lora)
    if r.tensor_parallel_size > 1 and r.gpus_per_worker != r.tensor_parallel_size:
        raise ConfigError(
            f"rollout.tensor_parallel_size {r.tensor_parallel_size} needs "
            f"rollout.gpus_per_worker {r.tensor_parallel_size} (a GPU per rank), "
            f"got {r.gpus_per_worker}"
        )
    _check_preference(config.preference)
    _check_weight_sync(config)
    if config.model.lora.rank and learner.num_workers > 1:
        raise ConfigError(
            "model.lora with learner.num_workers > 1: LoRA adapters train in one learner"
        )
    upper = {  # name: (value, largest allowed, why)
        "rollout.gpu_memory_utilization": (r.gpu_memory_utilization, 1.0, "a share"),
        "ingest.port": (config.ingest.port, 65535, "a TCP port"),
        "seed": (config.seed, 2**31 - 1 - r.num_workers, "numpy seeds are 32-bit"),
    }
    for name, (value, limit, why) in upper.items():
        if value > limit:
            raise ConfigError(f"{name} must be <= {limit} ({why}), got {value}")
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
    if r.min_new_tokens > r.max_new_tokens:
        raise ConfigError(
            f"rollout.min_new_tokens ({r.min_new_tokens}) must be <= rollout.max_new_tokens "
            f"({r.max_new_tokens})"
        )
    if r.temperature == 0:
        raise ConfigError("rollout.temperature must be > 0 (RL needs sampled episodes)")
    _check_stop_settings(r)
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
    _check_eval(config)


def _float_fields(value: Any, kind: Any, name: str = "") -> Iterator[tuple[str, float]]:
    """Yields (dotted name, value) of every float in the config, by the fields' types
    (reward.functions[0].weight and learner.resources.<key> included)."""
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        for f in dataclasses.fields(kind):
            dotted = f"{name}.{f.name}" if name else f.name
            yield from _float_fields(getattr(value, f.name), _field_types(kind)[f.name], dotted)
    elif origin in (typing.Union, types.UnionType) and value is not None:
        (inner,) = [t for t in typing.get_args(kind) if t is not type(None)]
        yield from _float_fields(value, inner, name)
    elif origin is list:
        for i, item in enumerate(value):
            yield from _float_fields(item, typing.get_args(kind)[0], f"{name}[{i}]")
    elif origin is dict:
        for key, item in value.items():
            yield from _float_fields(item, typing.get_args(kind)[1], f"{name}.{key}")
    elif kind is float and isinstance(value, (int, float)):
        yield name, value


def _check_algorithm(config: Config) -> None:
    a = config.algorithm
    if a.advantage == "grpo" and a.kl_mode == "reward" and a.kl_coef > 0:
        raise ConfigError(
            "algorithm.kl_mode reward with advantage grpo: dividing by a group's reward std "
            "turns the KL penalty of a group whose rewards are equal into full-size "
            "advantages; use kl_mode loss (k2 or k3) or kl_coef 0"
        )
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


def _check_preference(preference: PreferenceConfig) -> None:
    if not 0 <= preference.label_smoothing < 0.5:
        raise ConfigError(
            f"preference.label_smoothing must be in [0, 0.5), got {preference.label_smoothing}"
        )
    if preference.label_smoothing and preference.loss != "sigmoid":
        raise ConfigError("preference.label_smoothing applies to the sigmoid loss only")


def weight_sync(config: Config) -> str:
    """Returns how weights reach the rollout workers: "object_store", "nccl" or "gloo"
    (rollout.weight_sync with "auto" resolved)."""
    chosen = config.rollout.weight_sync
    if chosen != "auto":
        return chosen
    on_gpus = config.learner.gpus > 0 and config.rollout.gpus_per_worker > 0
    return "nccl" if on_gpus else "object_store"


def _check_weight_sync(config: Config) -> None:
    r, learner = config.rollout, config.learner
    if r.weight_sync == "nccl" and not (learner.gpus > 0 and r.gpus_per_worker > 0):
        raise ConfigError(
            "rollout.weight_sync nccl needs GPUs on both ends: learner.gpus "
            f"{learner.gpus}, rollout.gpus_per_worker {r.gpus_per_worker}"
        )
    if r.weight_sync == "gloo" and r.tensor_parallel_size > 1:
        raise ConfigError(
            "rollout.weight_sync gloo with rollout.tensor_parallel_size > 1: the gloo "
            "engine is registered in the rollout actor's process, not in its ranks'"
        )


def _check_lora(lora: LoraConfig) -> None:
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0 is off), got {lora.rank}")
    if lora.rank and not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if lora.rank and not lora.target_modules:
        raise ConfigError("model.lora.target_modules must name at least one module")
    if "all-linear" in lora.target_modules and len(lora.target_modules) > 1:
        raise ConfigError("model.lora.target_modules: all-linear stands alone")


def _check_stop_settings(r: RolloutConfig) -> None:
    """Raises ConfigError unless stop strings are non-empty and stop token ids >= 0
    (that they are in the model's vocabulary is checked with the model, in plan_run)."""
    for i, text in enumerate(r.stop):
        if not text:
            raise ConfigError(f"rollout.stop[{i}] is empty (an empty stop string ends at once)")
    for i, token in enumerate(r.stop_token_ids):
        if token < 0:
            raise ConfigError(f"rollout.stop_token_ids[{i}] must be >= 0, got {token}")


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


def eval_rewards(config: Config) -> list[RewardSpec]:
    """Returns the reward components held-out evaluation scores with."""
    return config.eval.rewards or config.reward.functions


def _check_eval(config: Config) -> None:
    e = config.eval
    if e.samples < 0:
        raise ConfigError(f"eval.samples must be >= 0, got {e.samples}")
    if e.samples and not e.temperature > 0:
        raise ConfigError(f"eval.temperature must be > 0 with eval.samples, got {e.temperature}")
    for i, k in enumerate(e.pass_k if e.samples else []):
        if not 1 <= k <= e.samples:
            raise ConfigError(
                f"eval.pass_k[{i}] must be in [1, eval.samples = {e.samples}], got {k}"
            )
    for i, spec in enumerate(e.rewards):
        _check_reward_spec(f"eval.rewards[{i}]", spec)
    names = [spec.name for spec in eval_rewards(config)]
    known = metric_names(names, e.samples, e.pass_k)
    if e.best_metric and e.best_metric not in known:
        raise ConfigError(
            f"eval.best_metric: no metric {e.best_metric!r}{_did_you_mean(e.best_metric, known)}; "
            f"with these settings there are {', '.join(known)}"
        )
