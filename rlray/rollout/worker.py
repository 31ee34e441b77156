"""RolloutWorker: a vLLM engine in this process that turns prompts into episodes.

A plain class: tests construct it in-process; rlray.cluster.roles wraps it in a Ray actor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from rlray.config import ModelConfig, RolloutConfig
from rlray.core.episode import Episode
from rlray.core.evaluation import EvalEpisodes
from rlray.core.parity import ParitySample, parity_gap
from rlray.core.prompt import PromptRow
from rlray.core.stats import EvalResult, GenerateStats
from rlray.data.chat import RenderedPrompt, episode_columns, render_prompt
from rlray.data.models import resolve_model_path
from rlray.rewards.text import exact_match
from rlray.rewards.trace import environment_total
from rlray.rollout.engine_loop import EngineLoop, Versions
from rlray.rollout.environments import load_environment
from rlray.rollout.multiturn import (
    Trajectory,
    TrajectoryRunner,
    TurnLimits,
    run_trajectories,
    tool_calls,
    turn_limits,
)
from rlray.rollout.partial import PartialBatches, PartialTrajectories
from rlray.rollout.sampling import (
    Generated,
    ModelCall,
    request_params,
    sampling_seed,
    stop_settings,
)

# vLLM must keep its engine in this process (a Ray actor), not fork its own.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's CPU build warns at every start about tuning that does not apply here.
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
    # glibc serves allocations over 32 MiB with fresh mmaps and returns freed memory at
    # once, so every weight reload (vLLM re-materialises and, on CPU, re-packs each
    # layer) page-faults its whole size again; keeping that memory in the heap makes a
    # 0.5 GB reload about twice as fast (BENCHMARKS.md). Read at process start.
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
}


# The heap VLLM_ENV keeps is worth keeping where a reload reuses it: as much memory as the
# weights. Below this size of weights, what a rollout batch leaves there is mostly its own
# garbage (50-70 MiB on the 2 MiB default model, after a few dozen batches), and it is given
# back after each batch (malloc_trim: ~3 ms; benchmarks/rollout_memory.py, BENCHMARKS.md).
KEEP_HEAP_FROM_WEIGHT_BYTES = 64 * 2**20


def weight_file_bytes(model_path: str) -> int | None:
    """Returns the size of a local model directory's weight files; None for a hub name."""
    directory = Path(model_path)
    if not directory.is_dir():
        return None
    files = [*directory.glob("*.safetensors"), *directory.glob("pytorch_model*.bin")]
    return sum(f.stat().st_size for f in files)


def heap_trimmer(model_path: str) -> Callable[[], object] | None:
    """Returns glibc's malloc_trim, bound to give all free heap back, where a model of
    this size should not keep its heap (KEEP_HEAP_FROM_WEIGHT_BYTES); None where it
    should, or where the C library has no malloc_trim (not glibc)."""
    size = weight_file_bytes(model_path)
    if size is None or size >= KEEP_HEAP_FROM_WEIGHT_BYTES:
        return None
    trim = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    return None if trim is None else lambda: trim(0)


def _exact_match_accuracy(greedy: list[Episode], rows: list[PromptRow]) -> float | None:
    """Returns the share of greedy completions that match their row's answer exactly;
    None unless every row is a text prompt with an answer (a chat reply is read by the
    eval rewards: an answer in tags, a boxed number)."""
    if not all("answer" in r.columns and isinstance(r.prompt, str) for r in rows):
        return None
    answers = [str(r.columns["answer"]) for r in rows]
    scores = exact_match([e.prompt for e in greedy], [e.completion for e in greedy], answer=answers)
    return sum(scores) / len(scores)


def _shown_prompt(row: PromptRow, episode: Episode) -> str:
    """Returns a prompt as an evaluation's example shows it: a text prompt whole, a chat
    prompt by its last message (its rendering repeats the template's system prompt)."""
    if isinstance(row.prompt, str):
        return episode.prompt
    return f"{row.prompt[-1]['content']} "


class _DropRotaryReloadWarning(logging.Filter):
    # Rotary embeddings have no weights to load; vLLM warns about them on every reload.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def vllm_env(rollout: RolloutConfig) -> dict[str, str]:
    """Returns the environment variables a rollout process needs before vLLM is imported."""
    env = dict(VLLM_ENV)
    if rollout.kv_cache_gib > 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(rollout.kv_cache_gib)
    if rollout.gpus_per_worker == 0 and rollout.enforce_eager:
        # An eager engine on the CPU still torch.compiles one helper of vLLM's sampler
        # (batched_count_greater_than, the sampled token's rank) at the first call that
        # asks for logprobs: inductor's C++ codegen, 15 s on 2 cores with its cache cold
        # (a fresh machine) and 1.8 s warm, and 37 MiB of compiler in the process.
        # Eager, that first call takes 0.02 s.
        env["TORCH_COMPILE_DISABLE"] = "1"
    if rollout.gpus_per_worker == 0:
        # vLLM's CPU linear layers are oneDNN matmuls, and oneDNN keeps a compiled
        # primitive for every batch size it has seen (up to 1024): decode steps of every
        # size from 1 to a batch's. Over 100 default-job batches 16 kept take 120 MiB
        # less, generating as fast (benchmarks/rollout_memory.py, BENCHMARKS.md).
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "16"
    return env


# Below this size of weights a CPU engine's matmuls are torch's (rollout.cpu_matmul auto):
# compiling and packing oneDNN's costs more than it saves (BENCHMARKS.md).
TORCH_MATMUL_BELOW_WEIGHT_BYTES = 16 * 2**20


def torch_cpu_matmul(rollout: RolloutConfig, weight_bytes: int | None) -> bool:
    """Whether a CPU engine's linear layers multiply with torch rather than oneDNN
    (rollout.cpu_matmul), given the size of the model's weight files (None: unknown)."""
    if rollout.cpu_matmul != "auto":
        return rollout.cpu_matmul == "torch"
    return weight_bytes is not None and weight_bytes < TORCH_MATMUL_BELOW_WEIGHT_BYTES


def set_cpu_matmul(torch_matmul: bool) -> None:
    """Has vLLM's CPU build set up the linear layers it loads from now on (each weight
    load sets them up again) with torch's matmul, keeping their weights as loaded, or
    with oneDNN's where it has it. Process-wide: one engine per process."""
    import torch  # a rollout process's: imported with vLLM, after vllm_env is set
    from vllm import _custom_ops  # as torch

    # vLLM 0.32 reads this flag whenever it processes a layer's loaded weights, and falls
    # back to torch's linear, weights kept, where oneDNN is missing.
    has_onednn = hasattr(torch.ops._C, "create_onednn_mm_handler")
    _custom_ops._supports_onednn = has_onednn and not torch_matmul


# vLLM's CPU attention keeps KV in blocks of up to this many tokens (its CPU default;
# the kernel takes multiples of 32). Passed explicitly so that kv_cache_bytes counts the
# same blocks vLLM allocates.
KV_BLOCK_TOKENS = 128


def kv_block_tokens(max_model_len: int) -> int:
    """Returns the KV block size for a model of max_model_len tokens: KV_BLOCK_TOKENS, or
    for a shorter model the multiple of 32 that holds it, so that a sequence's one block
    is not mostly padding (the embedded model: 64 tokens, half the cache otherwise)."""
    return min(KV_BLOCK_TOKENS, -(-max_model_len // 32) * 32)


def kv_cache_bytes(model_path: str, model: ModelConfig, rollout: RolloutConfig) -> int:
    """Returns the KV cache that holds every sequence of a rollout batch at
    model.max_model_len tokens, in whole blocks: keys and values of every layer, in the
    model's dtype.

    Larger batches (an evaluation set bigger than a rollout batch) still run: vLLM
    schedules them in waves. A cache too small for a rollout batch would make vLLM
    preempt and recompute sequences, which on the CPU build fails for seeded sampling
    ("CPU Generator does not use offset", vLLM 0.32). For the embedded model this is
    32 MiB (twice that with rollout.in_flight_updates: two batches), where a fixed 1 GiB
    (rlray's earlier default) was allocated and touched, and mostly unused."""
    # torch, transformers and vLLM load in the rollout actor only (see __init__)
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    value_bytes = 2 if model.dtype == "bfloat16" else 4
    per_token = 2 * text.num_hidden_layers * heads * head_dim * value_bytes
    sequences = rollout.prompts_per_batch * rollout.samples_per_prompt
    if rollout.in_flight_updates:  # two batches at once (RolloutConfig.in_flight_updates)
        sequences *= 2
    block = kv_block_tokens(model.max_model_len)
    blocks = -(-model.max_model_len // block)  # ceil
    return sequences * blocks * block * per_token


def engine_arguments(
    model_path: str, model: ModelConfig, rollout: RolloutConfig, sleep_mode: bool
) -> dict[str, Any]:
    """Returns the vLLM engine arguments a rollout worker's settings ask for, beside those
    every engine gets (model, dtype, seed, length, eager, logprobs mode). `sleep_mode`:
    the engine can sleep while a learner on the same GPU trains (GPU only)."""
    engine_args: dict[str, Any] = {}
    if rollout.gpus_per_worker > 0:
        engine_args["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        engine_args["enable_sleep_mode"] = sleep_mode
    if rollout.tensor_parallel_size > 1:
        # Ranks as Ray actors in this worker's placement group (rlray/cluster/placement.py).
        engine_args["tensor_parallel_size"] = rollout.tensor_parallel_size
        engine_args["distributed_executor_backend"] = "ray"
    else:
        engine_args["block_size"] = kv_block_tokens(model.max_model_len)
        if rollout.kv_cache_gib == 0:
            engine_args["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, model, rollout)
    # The actors get weight_sync resolved ("auto" is the object store here).
    sync = rollout.weight_sync
    if sync in ("nccl", "gloo"):
        # vLLM is imported in the rollout actor only, after vllm_env (RolloutWorker)
        from vllm.config import WeightTransferConfig

        if sync == "gloo":
            # it imports vLLM (as above)
            from rlray.weights.transfer import register_backends

            register_backends()  # before the engine: its worker creates the engine
        engine_args["weight_transfer_config"] = WeightTransferConfig(backend=sync)
    if rollout.gpus_per_worker == 0 or rollout.environment or rollout.in_flight_updates:
        # A prefill split across engine steps (chunked prefill) fails for seeded sampling
        # on the CPU build ("CPU Generator does not use offset", vLLM 0.32): a batch of
        # long prompts (a chat template's) splits so, and so may turns that arrive while
        # others decode, a batch that joins a running one (in-flight updates) or a weight
        # load after which every running request prefills again. Prefills wait for room.
        engine_args["enable_chunked_prefill"] = False
    if rollout.in_flight_updates and rollout.in_flight_kv_cache == "keep":
        # KV computed by older weights stays in running requests; no new request may
        # find it in the prefix cache.
        engine_args["enable_prefix_caching"] = False
    return engine_args


def new_attempt() -> str:
    """Returns a new generation attempt's tag, the last part of its episodes' ids: a batch
    regenerated after a failure, or by a resumed run, gets new ids, so the store never
    holds one id twice."""
    return uuid.uuid4().hex[:8]


class SampleKey(NamedTuple):
    """What makes a single-turn request's episode, besides vLLM's output."""

    row: PromptRow
    prompt: str
    """The prompt as the model read it (rendered)."""
    index: int
    """The prompt's index in the stream."""
    sample: int
    """The sample index of the request's first completion (the others follow it)."""
    attempt: str
    """The generation attempt's tag (new_attempt)."""


class RolloutWorker:
    """Generates completions with per-token logprobs; loads new weights in place."""

    def __init__(
        self,
        name: str,
        model_path: str,
        model: ModelConfig,
        rollout: RolloutConfig,
        run_id: str,
        seed: int,
        policy_version: int = 0,
        sleep_mode: bool = False,
    ):
        """`sleep_mode`: the engine can sleep (vLLM frees its KV cache and offloads its
        weights) while a learner on the same GPU trains; GPU only."""
        for key, value in vllm_env(rollout).items():
            os.environ.setdefault(key, value)
        # after vllm_env: vLLM reads it once, at import
        from vllm import LLM

        # The embedded model is built (or found cached) on this node: its path on the
        # driver's node may not exist here.
        model_path = resolve_model_path(model_path)

        self.name = name
        self.run_id = run_id
        self.seed = seed
        self.rollout = rollout
        engine_args = engine_arguments(model_path, model, rollout, sleep_mode)
        self.loads_directly = rollout.gpus_per_worker == 0 and torch_cpu_matmul(
            rollout, weight_file_bytes(model_path)
        )
        """Whether a weight load goes straight into the model's layers (load_weights): on
        CPU with torch's matmuls every layer keeps its weights as loaded, so vLLM's
        in-place reload, which restores and processes every layer around the load, has
        nothing to do but costs 4-5x the load (BENCHMARKS.md "vLLM's CPU matmuls")."""
        if rollout.gpus_per_worker == 0:
            set_cpu_matmul(self.loads_directly)
        self.llm = LLM(
            model=model_path,
            dtype=model.dtype,
            seed=seed,
            max_model_len=model.max_model_len,
            enforce_eager=rollout.enforce_eager,
            # Logprobs after temperature scaling: what the learner recomputes.
            logprobs_mode="processed_logprobs",
            **engine_args,
        )
        # Multi-turn rollouts: one environment per trajectory (rlray.rollout.multiturn).
        self.make_environment = (
            load_environment(rollout.environment) if rollout.environment else None
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.trim_heap = heap_trimmer(model_path)
        # Every call goes through the loop: with in_flight_updates the actor runs a
        # weight load (or a second batch) while a generate call is under way.
        self.loop = EngineLoop(self.llm.llm_engine, policy_version)
        self.partial = PartialBatches(self.loop)
        """Groups a partial rollout left running (generate_carrying)."""
        self.partial_turns = PartialTrajectories(self._trajectory_runner)
        """The same for multi-turn trajectories (rollout.environment)."""
        # A fast tokenizer may not be used by two threads at once ("Already borrowed").
        self.tokenizer_lock = threading.Lock()
        logging.getLogger("vllm").addFilter(_DropRotaryReloadWarning())
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(_DropRotaryReloadWarning())
        if model.dtype == "float32":
            # In bfloat16, vLLM 0.32's CPU build dies in a generate call made before the
            # first weight load (measured; float32 does not), which a run always makes.
            self._warm_up()

    @property
    def policy_version(self) -> int:
        """The learner version of the engine's weights."""
        return self.loop.version

    def _warm_up(self) -> None:
        """Generates one token with its logprob. vLLM sets up its logprobs path at the
        first call that asks for them (torch.compile of a sampler helper where it
        compiles: on GPUs, or on the CPU with rollout.enforce_eager false; see
        vllm_env), which is better paid while the other actors start than by the run's
        first evaluation."""
        prompt = {"prompt_token_ids": [self.tokenizer.eos_token_id or 0]}
        self.loop.generate([("warm-up", prompt, request_params(max_tokens=1, logprobs=0))])

    def release_batch_garbage(self) -> None:
        """Gives the heap's free memory back to the system after a batch, where this
        model's size says to (heap_trimmer)."""
        if self.trim_heap is not None:
            self.trim_heap()

    def generate(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Returns samples_per_prompt episodes per prompt, tagged with this worker's
        policy version, and a small stats record."""
        try:
            return self._generate(rows, first_prompt_index)
        finally:
            self.release_batch_garbage()

    def _generate(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        if self.make_environment is not None:
            return self._generate_turns(rows, first_prompt_index)
        started = time.perf_counter()
        rollout = self.rollout
        episodes = self._sampled(
            rows,
            first_prompt_index,
            rollout.samples_per_prompt,
            rollout.temperature,
            rollout.min_new_tokens,
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        return episodes, self._stats(episodes, tokens, seconds)

    def _sampled(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        samples: int,
        temperature: float,
        min_tokens: int = 0,
    ) -> list[Episode]:
        """Returns `samples` single-turn episodes per prompt (temperature 0: greedy)."""
        attempt = new_attempt()
        requests = [
            request
            for offset, row in enumerate(rows)
            for request in self._group_requests(
                row,
                first_prompt_index + offset,
                samples,
                temperature,
                min_tokens,
                attempt,
                one_request=not self.rollout.in_flight_updates,
            )
        ]
        outputs = self.loop.generate([(rid, prompt, params) for rid, prompt, params, _ in requests])
        now = time.time()
        return [
            episode
            for (*_, key), (output, versions) in zip(requests, outputs, strict=True)
            for episode in self._episodes(key, output, versions, now)
        ]

    def _group_requests(
        self,
        row: PromptRow,
        index: int,
        samples: int,
        temperature: float,
        min_tokens: int,
        attempt: str,
        one_request: bool = False,
    ) -> list[tuple[str, Any, Any, SampleKey]]:
        """Returns (request id, prompt, sampling params, key) of the stream's prompt
        `index`'s samples, in generation attempt `attempt` (new_attempt): one request
        each, or with `one_request` one request of `samples`: vLLM then takes in the
        prompt once, not once a sample, and the samples draw the same tokens
        (sampling_seed; BENCHMARKS.md, "Rollout throughput"). vLLM hands such a request's
        samples over when the last ends, with the versions of the request's first and
        last steps: each sample's own only where no weights load while requests run
        (rollout.in_flight_updates false)."""
        rendered = self.render(row)
        firsts = [0] if one_request else range(samples)
        return [
            (
                f"{attempt}-{index}-{first}",
                {"prompt_token_ids": rendered.token_ids},
                request_params(
                    n=samples if one_request else 1,
                    max_tokens=self.rollout.max_new_tokens,
                    min_tokens=min_tokens,
                    temperature=temperature,
                    logprobs=0,
                    seed=sampling_seed(self.seed, index, first),
                    detokenize=self.detokenizes,
                    **stop_settings(self.rollout),
                ),
                SampleKey(row, rendered.text, index, first, attempt),
            )
            for first in firsts
        ]

    def generate_carrying(
        self, rows: list[PromptRow], first_prompt_index: int, carry_floor: int | None
    ) -> tuple[list[Episode], GenerateStats]:
        """Partial rollouts (rlray.rollout.partial): starts `rows`' groups and returns
        once at most rollout.in_flight_carry of them are unfinished and every group
        still running started at or after policy version `carry_floor`; those stay in
        the engine for the next call. Returns every whole group, this call's and earlier
        calls', oldest first. `carry_floor` None returns every group held (a run's end).
        Multi-turn trajectories (rollout.environment) are carried alike."""
        if self.make_environment is not None:
            return self._carry_turns(rows, first_prompt_index, carry_floor)
        started = time.perf_counter()
        rollout = self.rollout
        indices = [first_prompt_index + offset for offset in range(len(rows))]
        attempt = new_attempt()
        for index, row in zip(indices, rows, strict=True):
            requests = self._group_requests(
                row,
                index,
                rollout.samples_per_prompt,
                rollout.temperature,
                rollout.min_new_tokens,
                attempt,
            )
            self.partial.add(index, requests)
        may_leave = int(len(rows) * rollout.in_flight_carry)
        groups = self.partial.take(indices, may_leave, carry_floor)
        now = time.time()
        episodes = [
            episode
            for group in groups
            for rid, key in group.keys.items()
            for episode in self._episodes(key, *group.outputs[rid], now)
        ]
        seconds = time.perf_counter() - started
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        stats = self._stats(episodes, tokens, seconds)
        stats.returned_prompts = sorted({g.prompt_index for g in groups})
        stats.first_prompt_index = min(stats.returned_prompts, default=None)
        stats.carried_prompts = self.partial.carried_prompts()
        return episodes, stats

    def _carry_turns(
        self, rows: list[PromptRow], first_prompt_index: int, carry_floor: int | None
    ) -> tuple[list[Episode], GenerateStats]:
        """generate_carrying for multi-turn trajectories (rlray.rollout.partial)."""
        started = time.perf_counter()
        samples = self.rollout.samples_per_prompt
        trajectories = self._trajectories(
            rows, first_prompt_index, self.make_environment, new_attempt()
        )
        indices = [first_prompt_index + offset for offset in range(len(rows))]
        for offset, index in enumerate(indices):
            self.partial_turns.add(index, trajectories[offset * samples : (offset + 1) * samples])
        may_leave = int(len(rows) * self.rollout.in_flight_carry)
        groups = self.partial_turns.take(indices, may_leave, carry_floor)
        now = time.time()
        episodes = [self._trajectory_episode(t, now) for group in groups for t in group]
        seconds = time.perf_counter() - started
        tokens = sum(sum(e.completion_mask) for e in episodes)
        stats = self._stats(episodes, tokens, seconds, *tool_calls(episodes))
        stats.returned_prompts = sorted({g[0].prompt_index for g in groups})
        stats.first_prompt_index = min(stats.returned_prompts, default=None)
        stats.carried_prompts = self.partial_turns.carried_prompts()
        return episodes, stats

    def _trajectory_runner(self) -> TrajectoryRunner:
        """Returns a runner of this worker's training trajectories (partial rollouts)."""
        sampling = self._turns(self.rollout.temperature)
        return TrajectoryRunner(
            self.loop.session(), self._encode, self._turn_text, sampling, turn_limits(self.rollout)
        )

    def complete(
        self,
        prompt_token_ids: list[int],
        n: int,
        temperature: float,
        max_tokens: int,
        stop: list[str],
        token_texts: bool = False,
    ) -> list[Generated]:
        """Samples `n` completions of one prompt given as token ids (an agent's model call,
        rlray.agent): the exact ids and logprobs vLLM sampled, the text, and the policy
        versions of the call's first and last steps. The run's stop settings apply too."""
        call = ModelCall(prompt_token_ids, n, temperature, max_tokens, stop, token_texts)
        (choices,) = self.complete_calls([call])
        return choices

    def complete_calls(self, calls: list[ModelCall]) -> list[list[Generated]]:
        """Samples several model calls in one engine session, as `complete` samples one:
        the calls an endpoint received together, in one actor call instead of one each.
        Returns each call's choices, in the order given, once every call ended."""
        requests = [self._call_request(call) for call in calls]
        outputs = self.loop.generate(requests)
        return [
            [
                self._generated(c, versions, call.token_texts, params.detokenize)
                for c in output.outputs
            ]
            for call, (_, _, params), (output, versions) in zip(
                calls, requests, outputs, strict=True
            )
        ]

    def _call_request(self, call: ModelCall) -> tuple[str, dict, Any]:
        """Returns (request id, prompt, sampling params) of one model call."""
        settings = stop_settings(self.rollout)
        stop_strings = settings["stop"] + list(call.stop)
        params = request_params(
            n=call.n,
            max_tokens=call.max_tokens,
            temperature=call.temperature,
            logprobs=0,
            stop=stop_strings,
            stop_token_ids=settings["stop_token_ids"],
            detokenize=bool(stop_strings),
        )
        request_id = f"call-{uuid.uuid4().hex[:12]}"
        return request_id, {"prompt_token_ids": call.prompt_token_ids}, params

    def _generated(
        self, completion: Any, versions: Versions, token_texts: bool, detokenized: bool
    ) -> Generated:
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        tokens = []
        if token_texts:
            with self.tokenizer_lock:
                tokens = [self.tokenizer.decode([t]) for t in token_ids]
        return Generated(
            token_ids,
            logprobs,
            self._completion_text(completion, detokenized),
            completion.finish_reason or "length",
            tokens,
            versions.first,
            versions.last,
        )

    @property
    def detokenizes(self) -> bool:
        """Whether vLLM detokenizes requests (batches, turns) as they run: stop strings need it.
        Without them each completion's text is decoded once, when it ends
        (_completion_text), which saves vLLM's detokenizing at every step, its logprobs'
        token texts included (BENCHMARKS.md, "Rollout throughput")."""
        return bool(self.rollout.stop)

    def _completion_text(self, completion: Any, detokenized: bool) -> str:
        """Returns a completion's text as vLLM's detokenizer makes it: special tokens
        skipped, and the text of a stop token that ended it left out. `detokenized`:
        whether vLLM made it already (its request's SamplingParams.detokenize)."""
        if detokenized:
            return completion.text
        token_ids = list(completion.token_ids)
        if completion.finish_reason == "stop":  # no stop strings: a stop token ended it
            token_ids = token_ids[:-1]
        with self.tokenizer_lock:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def render(self, row: PromptRow) -> RenderedPrompt:
        """Returns the row's prompt as the model reads it: vLLM is given its token ids,
        so the prompt is tokenised once, as the prompt checks counted it."""
        with self.tokenizer_lock:
            return render_prompt(self.tokenizer, row.prompt)

    def _generate_turns(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        started = time.perf_counter()
        episodes = self.multi_turn_episodes(rows, first_prompt_index)
        seconds = time.perf_counter() - started
        tokens = sum(sum(e.completion_mask) for e in episodes)
        return episodes, self._stats(episodes, tokens, seconds, *tool_calls(episodes))

    def _stats(
        self, episodes: list[Episode], tokens: int, seconds: float, calls: int = 0, errors: int = 0
    ) -> GenerateStats:
        """Returns a generate call's stats; its version is its episodes' oldest."""
        oldest = min((e.policy_version for e in episodes), default=self.policy_version)
        updated = sum(e.last_policy_version != e.policy_version for e in episodes)
        return GenerateStats(
            self.name, oldest, len(episodes), tokens, seconds, calls, errors, updated
        )

    def multi_turn_episodes(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        make_environment: Callable[[], Any] | None = None,
        limits: TurnLimits | None = None,
        samples: int | None = None,
        temperature: float | None = None,
    ) -> list[Episode]:
        """Returns `samples` (default rollout.samples_per_prompt) multi-turn episodes per
        prompt at `temperature` (default rollout.temperature; 0 is greedy), each with a
        fresh environment (default rollout.environment's), generated turn by turn within
        `limits` (default the rollout settings'; rlray.rollout.multiturn)."""
        rollout = self.rollout
        make_environment = make_environment or self.make_environment
        limits = limits or turn_limits(rollout)
        temperature = rollout.temperature if temperature is None else temperature
        trajectories = self._trajectories(
            rows, first_prompt_index, make_environment, new_attempt(), samples
        )
        session = self.loop.session()
        sampling = self._turns(temperature)
        run_trajectories(session, self._encode, self._turn_text, trajectories, sampling, limits)
        now = time.time()
        return [self._trajectory_episode(t, now) for t in trajectories]

    def _trajectories(
        self,
        rows: list[PromptRow],
        first_prompt_index: int,
        make_environment: Callable[[], Any],
        attempt: str,
        samples: int | None = None,
    ) -> list[Trajectory]:
        """Returns `samples` (default rollout.samples_per_prompt) trajectories per row, in
        row order, each with a fresh environment."""
        samples = self.rollout.samples_per_prompt if samples is None else samples
        rendered = [self.render(row) for row in rows]  # chat prompts by the chat template
        return [
            Trajectory(
                key=f"{first_prompt_index + offset}-{sample}-{attempt}",
                row=row,
                prompt_token_ids=list(rendered[offset].token_ids),
                environment=make_environment(),
                prompt_index=first_prompt_index + offset,
                sample_index=sample,
                prompt_text=rendered[offset].text,
                attempt=attempt,
            )
            for offset, row in enumerate(rows)
            for sample in range(samples)
        ]

    def _turns(self, temperature: float) -> Callable[[Trajectory, int], Any]:
        """Returns the SamplingParams of a trajectory's next turn, given its token limit."""

        def sampling(t: Trajectory, max_tokens: int) -> Any:
            return request_params(
                max_tokens=max_tokens,
                temperature=temperature,
                logprobs=0,
                seed=sampling_seed(self.seed, t.prompt_index, t.sample_index, t.turns),
                detokenize=self.detokenizes,
                **stop_settings(self.rollout),
            )

        return sampling

    def _turn_text(self, completion: Any) -> str:
        """Returns a finished turn's text (its SamplingParams are _turns')."""
        return self._completion_text(completion, self.detokenizes)

    def _encode(self, text: str) -> list[int]:
        """Returns an observation's token ids (no special tokens added)."""
        with self.tokenizer_lock:
            return self.tokenizer(text, add_special_tokens=False).input_ids

    def _trajectory_episode(self, t: Trajectory, now: float) -> Episode:
        index, sample = t.prompt_index, t.sample_index
        return Episode(
            run_id=self.run_id,
            episode_id=f"{self.run_id}-{index}-{sample}-{t.attempt}",
            prompt_index=index,
            sample_index=sample,
            prompt=t.prompt_text,
            completion=t.completion,
            prompt_token_ids=t.prompt_token_ids,
            completion_token_ids=t.completion_token_ids,
            rollout_logprobs=t.rollout_logprobs,
            finish_reason=t.finish_reason,
            policy_version=t.versions.first if t.versions else self.policy_version,
            last_policy_version=t.versions.last if t.versions else self.policy_version,
            rollout_worker=self.name,
            columns=episode_columns(t.row),
            generated_at=now,
            spans=t.spans,
            completion_mask=t.completion_mask,
        )

    def _episodes(
        self, key: SampleKey, output: Any, versions: Versions, now: float
    ) -> list[Episode]:
        """Returns the episode of each completion of a request's output."""
        return [
            self._episode(key, output, completion, versions, now) for completion in output.outputs
        ]

    def _episode(
        self, key: SampleKey, output: Any, completion: Any, versions: Versions, now: float
    ) -> Episode:
        sample = key.sample + completion.index
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        return Episode(
            run_id=self.run_id,
            episode_id=f"{self.run_id}-{key.index}-{sample}-{key.attempt}",
            prompt_index=key.index,
            sample_index=sample,
            prompt=key.prompt,
            completion=self._completion_text(completion, self.detokenizes),
            prompt_token_ids=list(output.prompt_token_ids),
            completion_token_ids=token_ids,
            rollout_logprobs=logprobs,
            finish_reason=completion.finish_reason or "length",
            policy_version=versions.first,
            last_policy_version=versions.last,
            rollout_worker=self.name,
            columns=episode_columns(key.row),
            generated_at=now,
        )

    def eval_episodes(
        self, rows: list[PromptRow], samples: int = 0, temperature: float = 1.0, examples: int = 3
    ) -> tuple[EvalEpisodes, EvalResult]:
        """Returns each held-out prompt's greedy episode and `samples` sampled ones at
        `temperature` (prompt_index -len(rows) + i for row i, as seeds and scores name
        it), and the greedy exact-match accuracy with a few examples.

        Sampling seeds depend on the run seed, the prompt and the sample only, so that
        every model evaluated with one seed draws with the same random numbers: their
        differences are the models', not the draws'."""
        try:
            return self._eval_episodes(rows, samples, temperature, examples)
        finally:
            self.release_batch_garbage()

    def _eval_episodes(
        self, rows: list[PromptRow], samples: int, temperature: float, examples: int
    ) -> tuple[EvalEpisodes, EvalResult]:
        first = -len(rows)
        if self.make_environment is not None:

            def run(count: int, temp: float) -> list[Episode]:
                return self.multi_turn_episodes(rows, first, samples=count, temperature=temp)

            greedy = run(1, 0.0)
            accuracy = sum(environment_total(e.spans) or 0.0 for e in greedy) / len(greedy)
        else:

            def run(count: int, temp: float) -> list[Episode]:
                return self._sampled(rows, first, count, temp)

            greedy = run(1, 0.0)
            accuracy = _exact_match_accuracy(greedy, rows)
        sampled = run(samples, temperature) if samples else []
        answers = [str(r.columns.get("answer", "")) for r in rows]
        shown = [
            (_shown_prompt(r, e), e.completion, a)
            for r, e, a in zip(rows, greedy, answers, strict=True)
        ]
        result = EvalResult(accuracy, self.policy_version, shown[:examples])
        return EvalEpisodes(greedy, sampled), result

    def evaluate(self, rows: list[PromptRow], examples: int = 3) -> EvalResult:
        """Returns the greedy exact-match accuracy against each row's 'answer' (None
        without answers; with an environment: the mean reward it gave greedy
        trajectories)."""
        return self.eval_episodes(rows, examples=examples)[1]

    def parity_gap(self, sample: ParitySample) -> float | None:
        """Returns how far this engine's logprobs of the sample's tokens are from the
        learner's (rlray.core.parity): a weight sync's check, made once the weights the
        learner had then are loaded."""
        return parity_gap(sample, self.token_logprobs(sample.episodes))

    def token_logprobs(self, episodes: list[Episode]) -> list[list[float]]:
        """Returns this engine's logprob of each episode's completion tokens, each after
        its prompt and the tokens before it, at temperature 1: the tokens go in as one
        prompt and vLLM gives its prompt logprobs (computed before any sampling
        processor, and never from a prefix cached under other weights). A prefill, no
        generation: how a weight sync is checked on a batch's own tokens."""
        if not episodes:  # the sync before any step: nothing to check
            return []
        attempt = uuid.uuid4().hex[:8]
        requests = [
            (
                f"parity-{attempt}-{i}",
                {"prompt_token_ids": [*e.prompt_token_ids, *e.completion_token_ids]},
                request_params(max_tokens=1, prompt_logprobs=0, detokenize=False),
            )
            for i, e in enumerate(episodes)
        ]
        outputs = self.loop.generate(requests)
        scored = []
        for episode, (output, _) in zip(episodes, outputs, strict=True):
            steps = output.prompt_logprobs[len(episode.prompt_token_ids) :]
            tokens = episode.completion_token_ids
            scored.append([step[token].logprob for step, token in zip(steps, tokens, strict=True)])
        return scored

    def close(self) -> None:
        """Shuts the engine down. It runs in this process (vllm_env turns vLLM's
        multiprocessing off): shutting it down frees its weights and KV cache (vLLM
        gc.freeze()s them at start) and its torch.distributed group, which the next
        engine in this process creates again. Trajectories carried by partial rollouts
        end here, with their environments' threads."""
        self.partial_turns.drop_all()
        self.llm.llm_engine.engine_core.shutdown()

    # vLLM's weight-transfer engine (rollout.weight_sync nccl or gloo; rlray.weights.transfer):
    # the learner's client calls these, and the tensors arrive inside update_weights.

    def open_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Joins the learner's transfer group (blocks until the learner opens it), leaving
        the group it was in (a reopened transfer's). The engine pauses meanwhile: its
        worker's group changes."""
        with self.loop.paused():
            self.llm.shutdown_weight_transfer_engine()
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pauses the engine (between two of its steps) until finish_weight_update: no
        step may run on half-loaded weights."""
        self.loop.hold()
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives every tensor the learner broadcasts and loads it (layerwise)."""
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, version: int) -> None:
        """Ends the update (vLLM processes the loaded layers); this worker holds `version`."""
        self.llm.finish_weight_update()
        self._loaded(version, self.llm.llm_engine.has_unfinished_requests())
        self.loop.release()

    def abandon_weight_update(self, reason: str) -> None:
        """The transfer's sender died (or its learner group broke) mid-sync: an update it
        started may hold the engine with its weights half-loaded, and nobody will finish
        it. The engine stops for good (EngineLoop.fail): the calls waiting for it, and any
        later, raise EngineFailed naming `reason`; the run goes on with new actors."""
        self.loop.fail(f"{self.name}: a weight transfer was abandoned ({reason})")

    def loads_tied_output(self, tied_output: str) -> bool:
        """Whether vLLM's model takes the tied output embedding under its own name."""
        # as in __init__
        from rlray.weights.packing import weights_for_vllm

        architecture = self.llm.model_config.architecture
        return tied_output in weights_for_vllm({tied_output: None}, tied_output, architecture)

    def load_weights(self, version: int, weights: Mapping) -> float:
        """Loads a published state dict in place and returns the seconds it took."""
        started = time.perf_counter()
        items = list(weights.items())

        def reload(worker) -> None:  # runs on vLLM's worker, in this process
            if self.loads_directly:
                worker.model_runner.get_model().load_weights(iter(items))
            else:
                worker.reload_weights(weights_iterator=iter(items))

        with self.loop.paused() as running:
            self.llm.collective_rpc(reload)
            self._loaded(version, running)
        return time.perf_counter() - started

    def _loaded(self, version: int, running: bool) -> None:
        """After a weight load: no cached KV of the old weights may serve a request that
        starts later (RolloutConfig.in_flight_kv_cache says what running ones do)."""
        if not running:
            self.llm.reset_prefix_cache()
        elif self.rollout.in_flight_kv_cache == "recompute":
            # vLLM preempts the running requests; they resume by recomputing their KV.
            self.llm.reset_prefix_cache(reset_running_requests=True)
        # keep: the prefix cache is off, and running requests keep their own KV
        self.loop.version = version
