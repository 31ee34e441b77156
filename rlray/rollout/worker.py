"""RolloutWorker: a vLLM engine in this process that turns prompts into episodes.

A plain class: tests construct it in-process; rlray.cluster.roles wraps it in a Ray actor.
This module sets the engine up (its process's environment, its arguments, its KV cache);
the worker's calls are in parts of their own: single-turn requests (model_calls.py),
multi-turn trajectories (turns.py), evaluation and the parity check (evaluating.py) and
weight loads (weight_loading.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlray.config import ModelConfig, RolloutConfig
from rlray.core.episode import Episode
from rlray.core.prompt import PromptRow
from rlray.core.stats import GenerateStats
from rlray.data.chat import RenderedPrompt, render_prompt
from rlray.data.models import resolve_model_path
from rlray.rollout.engine_loop import EngineLoop
from rlray.rollout.environments import load_environment
from rlray.rollout.evaluating import Evaluation
from rlray.rollout.model_calls import SingleTurnCalls
from rlray.rollout.partial import PartialBatches, PartialTrajectories
from rlray.rollout.sampling import request_params
from rlray.rollout.turns import MultiTurnRollouts
from rlray.rollout.weight_loading import WeightLoading, drop_rotary_reload_warnings

# vLLM must keep its engine in this process (a Ray actor), not fork its own.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's CPU build warns at every start about tuning that does not apply here.
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
    # glibc serves allocations over 32 MiB with fresh mmaps and returns freed memory at
    # once, so every weight reload (vLLM re-materialises and, on CPU, re-packs each
    # layer) page-faults its whole size again; keeping that memory in the heap lets a
    # reload reuse the pages instead. Read at process start.
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
}


# The heap VLLM_ENV keeps is worth keeping where a reload reuses it: as much memory as the
# weights. Below this size of weights, what a rollout batch leaves there is mostly its own
# garbage, and giving it back after each batch (malloc_trim) is cheap.
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


def vllm_env(rollout: RolloutConfig) -> dict[str, str]:
    """Returns the environment variables a rollout process needs before vLLM is imported."""
    env = dict(VLLM_ENV)
    if rollout.kv_cache_gib > 0:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(rollout.kv_cache_gib)
    if rollout.gpus_per_worker == 0 and rollout.enforce_eager:
        # An eager engine on the CPU still torch.compiles one helper of vLLM's sampler
        # (batched_count_greater_than, the sampled token's rank) at the first call that
        # asks for logprobs: inductor's C++ codegen costs seconds at that call (more with
        # its cache cold, on a fresh machine) and leaves the compiler in the process;
        # eager, that call costs nothing.
        env["TORCH_COMPILE_DISABLE"] = "1"
    if rollout.gpus_per_worker == 0:
        # vLLM's CPU linear layers are oneDNN matmuls, and oneDNN keeps a compiled
        # primitive for every batch size it has seen (up to 1024): decode steps of every
        # size from 1 to a batch's. Each holds memory, and a few cover the sizes a batch
        # reuses, generating as fast.
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "16"
    return env


# Below this size of weights a CPU engine's matmuls are torch's (rollout.cpu_matmul auto):
# compiling and packing oneDNN's costs more than it saves (BENCHMARKS.md#default-job).
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
    ("CPU Generator does not use offset", vLLM 0.32). It is sized to the job (twice a
    batch with rollout.in_flight_updates: two batches), not a fixed size that would be
    allocated, touched and mostly unused."""
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


def loads_weights_directly(rollout: RolloutConfig, model_path: str) -> bool:
    """Whether a weight load goes straight into the model's layers
    (WeightLoading.loads_directly): a CPU engine whose matmuls are torch's."""
    return rollout.gpus_per_worker == 0 and torch_cpu_matmul(rollout, weight_file_bytes(model_path))


def start_engine(
    model_path: str,
    model: ModelConfig,
    rollout: RolloutConfig,
    seed: int,
    sleep_mode: bool,
    loads_directly: bool,
) -> Any:
    """Returns a vLLM engine (vllm.LLM) in this process, with the arguments a rollout
    worker's settings ask for (engine_arguments) and, on CPU, its linear layers set up
    for `loads_directly` (set_cpu_matmul). vllm_env must be set before."""
    # after vllm_env: vLLM reads it once, at import
    from vllm import LLM

    engine_args = engine_arguments(model_path, model, rollout, sleep_mode)
    if rollout.gpus_per_worker == 0:
        set_cpu_matmul(loads_directly)
    llm = LLM(
        model=model_path,
        dtype=model.dtype,
        seed=seed,
        max_model_len=model.max_model_len,
        enforce_eager=rollout.enforce_eager,
        # Logprobs after temperature scaling: what the learner recomputes.
        logprobs_mode="processed_logprobs",
        **engine_args,
    )
    drop_rotary_reload_warnings()
    return llm


class RolloutWorker(SingleTurnCalls, MultiTurnRollouts, Evaluation, WeightLoading):
    """Generates completions with per-token logprobs; loads new weights in place.

    Holds the engine and its tokenizer, and sends each batch to its single-turn or its
    multi-turn part (rollout.environment); the calls themselves are the parts'."""

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
        # The embedded model is built (or found cached) on this node: its path on the
        # driver's node may not exist here.
        model_path = resolve_model_path(model_path)
        self.name = name
        self.run_id = run_id
        self.seed = seed
        self.rollout = rollout
        self.loads_directly = loads_weights_directly(rollout, model_path)
        self.llm = start_engine(model_path, model, rollout, seed, sleep_mode, self.loads_directly)
        # Multi-turn rollouts: one environment per trajectory (rlray.rollout.multiturn).
        environment = rollout.environment
        self.make_environment = load_environment(environment) if environment else None
        self.tokenizer = self.llm.get_tokenizer()
        # A fast tokenizer may not be used by two threads at once ("Already borrowed").
        self.tokenizer_lock = threading.Lock()
        self.trim_heap = heap_trimmer(model_path)
        # Every call goes through the loop: with in_flight_updates the actor runs a
        # weight load (or a second batch) while a generate call is under way.
        self.loop = EngineLoop(self.llm.llm_engine, policy_version)
        self.partial = PartialBatches(self.loop)
        self.partial_turns = PartialTrajectories(self._trajectory_runner)
        if model.dtype == "float32":  # not in bfloat16: see _warm_up
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
        first evaluation. Float32 engines only: in bfloat16, vLLM 0.32's CPU build dies
        in a generate call made before the first weight load (float32 does not), which a
        run always makes."""
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
            if self.make_environment is not None:
                return self._generate_turns(rows, first_prompt_index)
            return self._generate_sampled(rows, first_prompt_index)
        finally:
            self.release_batch_garbage()

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
        return self._carry_sampled(rows, first_prompt_index, carry_floor)

    def close(self) -> None:
        """Shuts the engine down. It runs in this process (vllm_env turns vLLM's
        multiprocessing off): shutting it down frees its weights and KV cache (vLLM
        gc.freeze()s them at start) and its torch.distributed group, which the next
        engine in this process creates again. Trajectories carried by partial rollouts
        end here, with their environments' threads."""
        self.partial_turns.drop_all()
        self.llm.llm_engine.engine_core.shutdown()

    def render(self, row: PromptRow) -> RenderedPrompt:
        """Returns the row's prompt as the model reads it: vLLM is given its token ids,
        so the prompt is tokenised once, as the prompt checks counted it."""
        with self.tokenizer_lock:
            return render_prompt(self.tokenizer, row.prompt)

    @property
    def detokenizes(self) -> bool:
        """Whether vLLM detokenizes requests (batches, turns) as they run: stop strings need it.
        Without them each completion's text is decoded once, when it ends
        (_completion_text), which saves vLLM's detokenizing at every step, its logprobs'
        token texts included (BENCHMARKS.md#rollout-throughput-against-plain-vllm)."""
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

    def _stats(
        self, episodes: list[Episode], tokens: int, seconds: float, calls: int = 0, errors: int = 0
    ) -> GenerateStats:
        """Returns a generate call's stats; its version is its episodes' oldest."""
        oldest = min((e.policy_version for e in episodes), default=self.policy_version)
        updated = sum(e.last_policy_version != e.policy_version for e in episodes)
        return GenerateStats(
            self.name, oldest, len(episodes), tokens, seconds, calls, errors, updated
        )
