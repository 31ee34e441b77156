"""RolloutWorker: a vLLM engine in this process that turns prompts into episodes.

A plain class: tests construct it in-process; rlray.actors wraps it in a Ray actor.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from rlray.chat import RenderedPrompt, episode_columns, render_prompt
from rlray.config import ModelConfig, RolloutConfig
from rlray.data import PromptRow
from rlray.episode import Episode
from rlray.models import resolve_model_path
from rlray.multiturn import (
    environment_reward,
    load_environment,
    multi_turn_episodes,
    tool_calls,
    turn_limits,
)
from rlray.rewards import exact_match

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


@dataclass
class GenerateStats:
    """Small summary of one generate call, sent to the driver instead of the episodes."""

    worker: str
    policy_version: int
    episodes: int
    completion_tokens: int
    """Tokens the policy generated (observation tokens of multi-turn episodes aside)."""
    seconds: float
    tool_calls: int = 0
    """Tool calls of multi-turn episodes (tool_call spans), and how many failed."""
    tool_errors: int = 0


@dataclass
class EvalResult:
    """Greedy exact-match accuracy on held-out prompts at one policy version."""

    accuracy: float
    policy_version: int
    examples: list[tuple[str, str, str]]  # (prompt, completion, answer), the first few


class _DropRotaryReloadWarning(logging.Filter):
    # Rotary embeddings have no weights to load; vLLM warns about them on every reload.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def vllm_env(rollout: RolloutConfig) -> dict[str, str]:
    """Returns the environment variables a rollout process needs before vLLM is imported."""
    if rollout.kv_cache_gib > 0:
        return {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": str(rollout.kv_cache_gib)}
    return dict(VLLM_ENV)


# vLLM's CPU attention keeps KV in blocks of this many tokens (its CPU default; the
# kernel takes multiples of 32). Passed explicitly so that kv_cache_bytes counts the
# same blocks vLLM allocates.
KV_BLOCK_TOKENS = 128


def kv_cache_bytes(model_path: str, model: ModelConfig, rollout: RolloutConfig) -> int:
    """Returns the KV cache that holds every sequence of a rollout batch at
    model.max_model_len tokens, in whole blocks: keys and values of every layer, in the
    model's dtype.

    Larger batches (an evaluation set bigger than a rollout batch) still run: vLLM
    schedules them in waves. A cache too small for a rollout batch would make vLLM
    preempt and recompute sequences, which on the CPU build fails for seeded sampling
    ("CPU Generator does not use offset", vLLM 0.32). For the embedded model this is
    64 MiB, where a fixed 1 GiB (rlray's earlier default) was allocated and touched,
    and mostly unused."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    value_bytes = 2 if model.dtype == "bfloat16" else 4
    per_token = 2 * text.num_hidden_layers * heads * head_dim * value_bytes
    sequences = rollout.prompts_per_batch * rollout.samples_per_prompt
    blocks = -(-model.max_model_len // KV_BLOCK_TOKENS)  # ceil
    return sequences * blocks * KV_BLOCK_TOKENS * per_token


def stop_settings(rollout: RolloutConfig) -> dict[str, list]:
    """Returns the SamplingParams arguments of the stop settings (rollout.stop,
    rollout.stop_token_ids): the same for generation, evaluation and every turn."""
    return {"stop": list(rollout.stop), "stop_token_ids": list(rollout.stop_token_ids)}


def sampling_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """Returns the per-request vLLM seed: sampling does not depend on batch composition."""
    return (run_seed * 1_000_003 + prompt_index * 131 + sample_index) % (2**31 - 1)


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
    ):
        for key, value in vllm_env(rollout).items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        # The embedded model is built (or found cached) on this node: its path on the
        # driver's node may not exist here.
        model_path = resolve_model_path(model_path)

        self.name = name
        self.run_id = run_id
        self.seed = seed
        self.rollout = rollout
        self.policy_version = policy_version
        engine_args = {}
        if rollout.gpus_per_worker > 0:
            engine_args["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        else:
            engine_args["block_size"] = KV_BLOCK_TOKENS
            if rollout.kv_cache_gib == 0:
                engine_args["kv_cache_memory_bytes"] = kv_cache_bytes(model_path, model, rollout)
        if rollout.environment:
            # Turns arrive while others decode, and a prefill split across engine steps
            # (chunked prefill) fails for seeded sampling on the CPU build ("CPU Generator
            # does not use offset", vLLM 0.32): prefills wait for room instead.
            engine_args["enable_chunked_prefill"] = False
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
        # Multi-turn rollouts: one environment per trajectory (rlray.multiturn).
        self.make_environment = (
            load_environment(rollout.environment) if rollout.environment else None
        )
        self.tokenizer = self.llm.get_tokenizer()
        logging.getLogger("vllm").addFilter(_DropRotaryReloadWarning())
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(_DropRotaryReloadWarning())

    def generate(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        """Returns samples_per_prompt episodes per prompt, tagged with this worker's
        policy version, and a small stats record."""
        from vllm import SamplingParams

        if self.make_environment is not None:
            return self._generate_turns(rows, first_prompt_index)

        samples = self.rollout.samples_per_prompt
        prompts, params, keys = [], [], []
        for offset, row in enumerate(rows):
            index = first_prompt_index + offset
            rendered = self.render(row)
            for sample in range(samples):
                prompts.append({"prompt_token_ids": rendered.token_ids})
                params.append(
                    SamplingParams(
                        max_tokens=self.rollout.max_new_tokens,
                        min_tokens=self.rollout.min_new_tokens,
                        temperature=self.rollout.temperature,
                        logprobs=0,
                        seed=sampling_seed(self.seed, index, sample),
                        **stop_settings(self.rollout),
                    )
                )
                keys.append((row, rendered.text, index, sample))
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        now = time.time()
        # Ids are unique per generation attempt: a batch regenerated after a failure, or
        # by a resumed run, gets new ones, so the store never holds one id twice.
        attempt = uuid.uuid4().hex[:8]
        episodes = [
            self._episode(row, text, index, sample, output, now, attempt)
            for (row, text, index, sample), output in zip(keys, outputs, strict=True)
        ]
        tokens = sum(len(e.completion_token_ids) for e in episodes)
        stats = GenerateStats(self.name, self.policy_version, len(episodes), tokens, seconds)
        return episodes, stats

    def render(self, row: PromptRow) -> RenderedPrompt:
        """Returns the row's prompt as the model reads it: vLLM is given its token ids,
        so the prompt is tokenised once, as the prompt checks counted it."""
        return render_prompt(self.tokenizer, row.prompt)

    def _generate_turns(
        self, rows: list[PromptRow], first_prompt_index: int
    ) -> tuple[list[Episode], GenerateStats]:
        started = time.perf_counter()
        limits = turn_limits(self.rollout)
        episodes = multi_turn_episodes(
            self, rows, first_prompt_index, self.make_environment, limits
        )
        seconds = time.perf_counter() - started
        tokens = sum(sum(e.completion_mask) for e in episodes)
        calls, errors = tool_calls(episodes)
        stats = GenerateStats(
            self.name, self.policy_version, len(episodes), tokens, seconds, calls, errors
        )
        return episodes, stats

    def _episode(
        self,
        row: PromptRow,
        prompt: str,
        index: int,
        sample: int,
        output,
        now: float,
        attempt: str,
    ) -> Episode:
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        return Episode(
            run_id=self.run_id,
            episode_id=f"{self.run_id}-{index}-{sample}-{attempt}",
            prompt_index=index,
            sample_index=sample,
            prompt=prompt,
            completion=completion.text,
            prompt_token_ids=list(output.prompt_token_ids),
            completion_token_ids=token_ids,
            rollout_logprobs=logprobs,
            finish_reason=completion.finish_reason or "length",
            policy_version=self.policy_version,
            rollout_worker=self.name,
            columns=episode_columns(row),
            generated_at=now,
        )

    def evaluate(self, rows: list[PromptRow], examples: int = 3) -> EvalResult:
        """Returns greedy-decoding exact-match accuracy against each row's 'answer' (with
        an environment: the mean of the rewards it gave greedy trajectories)."""
        from vllm import SamplingParams

        if self.make_environment is not None:
            return self._evaluate_turns(rows, examples)

        params = SamplingParams(
            max_tokens=self.rollout.max_new_tokens, temperature=0.0, **stop_settings(self.rollout)
        )
        rendered = [self.render(r) for r in rows]
        prompts = [{"prompt_token_ids": r.token_ids} for r in rendered]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        texts = [r.text for r in rendered]
        completions = [o.outputs[0].text for o in outputs]
        answers = [str(r.columns["answer"]) for r in rows]
        scores = exact_match(texts, completions, answer=answers)
        shown = list(zip(texts, completions, answers, strict=True))[:examples]
        return EvalResult(sum(scores) / len(scores), self.policy_version, shown)

    def _evaluate_turns(self, rows: list[PromptRow], examples: int) -> EvalResult:
        limits = turn_limits(self.rollout)
        episodes = multi_turn_episodes(self, rows, 0, self.make_environment, limits, greedy=True)
        rewards = [environment_reward(e) or 0.0 for e in episodes]
        answers = [str(r.columns.get("answer", "")) for r in rows]
        shown = [(e.prompt, e.completion, a) for e, a in zip(episodes, answers, strict=True)]
        return EvalResult(sum(rewards) / len(rewards), self.policy_version, shown[:examples])

    def load_weights(self, version: int, weights: Mapping) -> float:
        """Loads a published state dict in place and returns the seconds it took."""
        started = time.perf_counter()
        items = list(weights.items())

        def reload(worker) -> None:  # runs on vLLM's worker, in this process
            worker.reload_weights(weights_iterator=iter(items))

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()
        self.policy_version = version
        return time.perf_counter() - started
