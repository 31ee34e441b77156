"""The agent endpoint's cost: the same model calls made by concurrent agents through the
endpoint (HTTP, the official openai client) and directly on the rollout worker (a Ray
call to RolloutWorker.complete), side by side in one run.

    python benchmarks/agent_endpoint.py                     # 32 agents, 2 rounds
    python benchmarks/agent_endpoint.py --agents 64 --calls 4 --rounds 3
    python benchmarks/agent_endpoint.py --cpu-matmul onednn  # vLLM's oneDNN matmuls

One rollout actor and one agent endpoint actor, started as a run starts them, on the
embedded model. Each agent plays the built-in arithmetic task's prompts: `--calls`
chat calls per task, each a fresh conversation with the task's prompt (rendered by the
chat template as the endpoint renders it), at temperature 1 with the run's
max_new_tokens. The agents run as threads of `--processes` processes of their own (as
agent programs would), or all in one process (`endpoint-1-process`); `endpoint-httpx`
posts the same JSON with httpx (the endpoint without the openai client's own CPU,
which on a small machine competes with the engine). The direct path makes the same
calls with the same prompt token ids from as many threads of this process. The paths
take turns `--rounds` times; prints tokens/s of each and their ratio, the per-call
latency (median and p95) of each with the endpoint's added share, and the CPU each
process spent per call.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlray.agent.gateway import CallLimits
from rlray.cluster.endpoints import AgentActor
from rlray.cluster.roles import RolloutActor
from rlray.config import AgentConfig, DataConfig, ModelConfig, RolloutConfig
from rlray.data.models import load_tokenizer, resolve_model_path
from rlray.data.prompts import train_prompts
from rlray.rollout.worker import vllm_env

TOKEN = "bench"
PATHS = {  # name: (client, agent processes)
    "direct": ("ray", None),
    "endpoint": ("openai", "many"),
    "endpoint-1-process": ("openai", "one"),
    "endpoint-httpx": ("httpx", "many"),
}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def direct(rollout, prompts: list[list[int]], agents: int, calls: int, max_tokens: int):
    """Returns (tokens, seconds, latencies) of agents x calls direct calls."""

    def call(index: int, number: int) -> int:
        ids = prompts[(index * calls + number) % len(prompts)]
        (made,) = ray.get(rollout.complete.remote(ids, 1, 1.0, max_tokens, []), timeout=120)
        return len(made.token_ids)

    return timed([call] * agents, calls)


def joined(endpoint) -> tuple[int, int]:
    """Returns (model calls, rollout actor calls) the endpoint made so far (JoinedCalls)."""
    return ray.get(endpoint.__ray_call__.remote(lambda a: (a.joined.calls, a.joined.sent)))


def through_endpoint(
    endpoint, url: str, pool, agents: int, calls: int, max_tokens: int, client: str
) -> tuple[int, float, list[float], float]:
    """Returns (tokens, seconds, latencies, client CPU seconds) of agents x calls chat
    calls, agents taking one task each from a batch of `agents` tasks (taken, and each
    agent's client made, before the clock starts; ended after it stops). The agents run
    as threads of the pool's processes, `agents / processes` each, as agent programs of
    their own would; with a pool of one process, all of them share one interpreter."""
    rows = train_prompts(DataConfig(), seed=0)
    batch = endpoint.run_batch.options(num_returns=2).remote(
        [rows.row(i) for i in range(agents)], 0, 1, 0
    )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    works = [
        httpx.get(f"{url}/v1/tasks/next", headers=headers, timeout=60).json() for _ in range(agents)
    ]
    shares = [works[i :: pool._processes] for i in range(pool._processes)]
    start_at = time.time() + 2.0  # every process has its clients made by then
    played = pool.starmap(play, [(share, calls, max_tokens, client, start_at) for share in shares])
    for work in works:
        httpx.post(f"{url}/v1/traces/{work['trace_id']}/end", headers=headers, timeout=60)
    ray.get(list(batch), timeout=300)
    tokens = sum(p[0] for p in played)
    seconds = max(p[2] for p in played) - min(p[1] for p in played)
    latencies = [latency for p in played for latency in p[3]]
    return tokens, seconds, latencies, sum(p[4] for p in played)


def play(works: list[dict], calls: int, max_tokens: int, client: str, start_at: float):
    """One agent process: returns (tokens, started, ended, latencies, CPU seconds) of
    its agents' calls, made from `start_at` (time.time()). `client`: the official openai
    client, or httpx posting the same JSON (the endpoint without the openai client's own
    CPU)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def agent_of(work: dict):
        messages = [{"role": "user", "content": work["task"]["prompt"]}]
        if client == "httpx":
            session = httpx.Client(headers=headers, timeout=60)
            body = {"model": "solver", "messages": messages, "max_tokens": max_tokens}

            def post(index: int, number: int) -> int:
                reply = session.post(f"{work['base_url']}/chat/completions", json=body)
                return reply.json()["usage"]["completion_tokens"]

            return post
        openai_client = openai.OpenAI(base_url=work["base_url"], api_key=TOKEN)

        def call(index: int, number: int) -> int:
            reply = openai_client.chat.completions.create(
                model="solver", messages=messages, max_tokens=max_tokens, temperature=1.0
            )
            return reply.usage.completion_tokens

        return call

    agents = [agent_of(work) for work in works]
    time.sleep(max(0.0, start_at - time.time()))
    cpu, started = time.process_time(), time.time()
    tokens, seconds, latencies = timed(agents, calls)
    return tokens, started, started + seconds, latencies, time.process_time() - cpu


def timed(agents: list, calls: int) -> tuple[int, float, list[float]]:
    """Runs each agent's `calls` calls one after another, the agents at once; returns
    (tokens, seconds, each call's latency)."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def run(index: int) -> None:
        for number in range(calls):
            started = time.perf_counter()
            made = agents[index](index, number)
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens[0] += made

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(agents))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return tokens[0], time.perf_counter() - started, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--calls", type=int, default=16, help="calls per agent and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--processes", type=int, default=4, help="agent processes, agents / processes each"
    )
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS, default=list(PATHS), help="direct is always run"
    )
    parser.add_argument(
        "--cpu-matmul",
        choices=["auto", "onednn", "torch"],
        default="auto",
        help="rollout.cpu_matmul (auto: torch's for the embedded model)",
    )
    args = parser.parse_args()
    # in-flight updates: as agent.enabled starts the rollout workers
    rollout_config = RolloutConfig(in_flight_updates=True, cpu_matmul=args.cpu_matmul)
    model = resolve_model_path("builtin:tiny-arithmetic")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, log_to_driver=False)
    rollout = (
        ray.remote(RolloutActor)
        .options(
            name="rollout-0",
            num_cpus=1,
            max_concurrency=args.agents + 2,
            runtime_env={"env_vars": vllm_env(rollout_config)},
        )
        .remote("rollout-0", model, ModelConfig(path=model), rollout_config, "bench", 0)
    )
    limits = CallLimits(64, rollout_config.max_new_tokens, 10_000, args.calls)
    endpoint = (
        ray.remote(AgentActor)
        .options(num_cpus=0, max_concurrency=args.agents + 8)
        .remote(
            AgentConfig(enabled=True, token=TOKEN),
            TOKEN,
            model,
            ["rollout-0"],
            limits,
            "bench",
        )
    )
    url = ray.get(endpoint.url.remote(), timeout=300)
    tokenizer = load_tokenizer(model)
    rows = train_prompts(DataConfig(), seed=0)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": rows.row(i).prompt}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        ).input_ids
        for i in range(args.agents)
    ]
    max_tokens = rollout_config.max_new_tokens
    context = multiprocessing.get_context("spawn")  # the agents' processes: no Ray in them
    pools = {"many": context.Pool(args.processes), "one": context.Pool(1)}
    paths = {name: PATHS[name] for name in PATHS if name == "direct" or name in args.paths}
    direct(rollout, prompts, args.agents, 2, max_tokens)  # warm every path up
    for client, pool in list(paths.values())[1:]:
        through_endpoint(endpoint, url, pools[pool], args.agents, 2, max_tokens, client)
    totals = {name: [0, 0.0, []] for name in paths}
    processes = {"client": psutil.Process()}  # for direct calls; else the agents' own
    for role, actor in (("rollout", rollout), ("agent", endpoint)):
        processes[role] = psutil.Process(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())))
    cpu = {name: dict.fromkeys(processes, 0.0) for name in totals}
    actor_calls = {name: [0, 0] for name in totals}  # model calls, rollout actor calls
    for _ in range(args.rounds):
        for name, (client, pool) in paths.items():
            before = {role: sum(p.cpu_times()[:2]) for role, p in processes.items()}
            joined_before = joined(endpoint)  # what the warm-up made
            if pool is None:
                tokens, seconds, latencies = direct(
                    rollout, prompts, args.agents, args.calls, max_tokens
                )
            else:
                tokens, seconds, latencies, client_cpu = through_endpoint(
                    endpoint, url, pools[pool], args.agents, args.calls, max_tokens, client
                )
            for role, process in processes.items():
                cpu[name][role] += sum(process.cpu_times()[:2]) - before[role]
            if pool is not None:  # the clients are the agents' processes, not this one
                cpu[name]["client"] += client_cpu - (
                    sum(processes["client"].cpu_times()[:2]) - before["client"]
                )
            if pool is None:  # one actor call per model call
                actor_calls[name][0] += len(latencies)
                actor_calls[name][1] += len(latencies)
            else:
                (calls_after, sent_after), (calls_before, sent_before) = (
                    joined(endpoint),
                    joined_before,
                )
                actor_calls[name][0] += calls_after - calls_before
                actor_calls[name][1] += sent_after - sent_before
            totals[name][0] += tokens
            totals[name][1] += seconds
            totals[name][2] += latencies
    for pool in pools.values():
        pool.close()
    print(f"{args.agents} agents, {args.calls} calls each, {args.rounds} rounds per path")
    rates = {}
    for name, (tokens, seconds, latencies) in totals.items():
        rates[name] = tokens / seconds
        median, p95 = statistics.median(latencies), percentile(latencies, 0.95)
        totals[name].append((median, p95))
        print(
            f"{name:18s} {rates[name]:7.1f} tokens/s  latency median {median * 1000:6.1f} ms"
            f"  p95 {p95 * 1000:6.1f} ms  ({len(latencies)} calls)"
        )
        per_call = ", ".join(
            f"{role} {seconds / len(latencies) * 1000:.1f}" for role, seconds in cpu[name].items()
        )
        print(f"{'':18s} CPU ms per call: {per_call}")
        calls, sent = actor_calls[name]
        print(f"{'':18s} {calls} model calls in {sent} rollout actor calls")
    d_median, d_p95 = totals["direct"][3]
    for name in list(paths)[1:]:
        e_median, e_p95 = totals[name][3]
        print(
            f"{name} / direct: tokens/s {rates[name] / rates['direct']:.2f}x, latency "
            f"median {e_median / d_median - 1:+.1%}, p95 {e_p95 / d_p95 - 1:+.1%}"
        )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
