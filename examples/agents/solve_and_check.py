"""A solver and a checker, both played by the policy a run trains, agree on an answer.

An agent program written with the `openai` package and the standard library alone:
nothing here imports rlray. It asks the run for tasks until the run needs no more, and
plays each task in rounds:

- the solver answers the task, continuing its own conversation (a second round's prompt
  is the first round's, its answer, and the task again);
- the checker answers it afresh, without seeing the solver's answer;
- they agree when the two answers are the same, and the task ends; else the next round,
  three rounds at most.

Rewards, posted per call: half the call's answer quality (1 if its answer is right),
half the trace's coordination (1 when solver and checker agreed on the right answer,
0.25 less for each round past the first: agreeing sooner is better; 0 when they agreed
on a wrong answer or never agreed). The trace's reward is their mean, with components
`quality` (the share of right answers), `coordination` and `correct` (they agreed on
the right answer: the task's success). Each round is posted as an event, so the run's
store shows the trace turn by turn.

    export RLRAY_AGENT_TOKEN=...   # the run's agent.token
    python examples/agents/solve_and_check.py http://127.0.0.1:PORT --agents 8

`--agents N` plays N tasks at once (threads); every agent exits when the run is done.
A task whose trace the run no longer knows (404, 409: its endpoint restarted, or the
trace timed out), or whose endpoint went away under it, is left, and the agent takes
the next; while the endpoint is unreachable, it asks again for up to a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from openai import (
    APIConnectionError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    OpenAI,
)

ROUNDS = 3
COMPONENTS = ("correct", "quality", "coordination")
UNREACHABLE_S = 60.0  # how long the endpoint may be unreachable (restarting)


class Run:
    """The run's agent endpoint: tasks out, events and rewards in."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url.rstrip("/"), token

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")

    def next_task(self) -> dict[str, Any] | None:
        """Returns the next task, or None once the run needs no more (204)."""
        unreachable_since = None
        while True:
            try:
                status, work = self.request("GET", "/v1/tasks/next")
            except urllib.error.HTTPError as err:
                if err.code != 503:  # 503: no work yet, ask again
                    raise
                time.sleep(float(err.headers.get("Retry-After", "1")))
                continue
            except (urllib.error.URLError, ConnectionError):  # restarting, or gone
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > UNREACHABLE_S:
                    raise
                time.sleep(1.0)
                continue
            return None if status == 204 else work

    def post(self, trace_id: str, what: str, body: dict[str, Any]) -> None:
        self.request("POST", f"/v1/traces/{trace_id}/{what}", body)


def retried(call: Callable[[], Any]) -> Any:
    """Returns call()'s result, asked again every second while the endpoint answers 503
    or is unreachable, for up to UNREACHABLE_S."""
    started = time.monotonic()
    while True:
        try:
            return call()
        except (APIConnectionError, InternalServerError) as err:  # 503 is one
            busy = isinstance(err, APIConnectionError) or err.status_code == 503
            if not busy or time.monotonic() - started > UNREACHABLE_S:
                raise
            time.sleep(1.0)


def play(run: Run, work: dict[str, Any], temperature: float) -> dict[str, float]:
    """Plays one task; posts and returns its reward components."""
    # Retried here, once a second: while a rollout engine restarts its calls are
    # answered 503 (Retry-After: 1), while the endpoint restarts they are refused.
    client = OpenAI(base_url=work["base_url"], api_key=run.token, max_retries=0)
    task, trace = work["task"], work["trace_id"]

    calls: dict[str, bool] = {}  # each call's response id: whether its answer is right

    def ask(role: str, messages: list[dict[str, str]]) -> str:
        reply = retried(
            lambda: client.chat.completions.create(
                model=role, messages=messages, temperature=temperature
            )
        )
        answer = reply.choices[0].message.content or ""
        calls[reply.id] = answer.strip() == str(task["answer"])
        return answer

    solver: list[dict[str, str]] = []
    rounds, agreed = 0, False
    while rounds < ROUNDS and not agreed:
        rounds += 1
        solver.append({"role": "user", "content": task["prompt"]})
        answer = ask("solver", solver)
        solver.append({"role": "assistant", "content": answer})  # as the model wrote it
        check = ask("checker", [{"role": "user", "content": task["prompt"]}])
        agreed = answer.strip() == check.strip()
        event = {"name": "round", "detail": f"{answer} / {check}", "value": float(agreed)}
        run.post(trace, "events", event)
    correct = agreed and answer.strip() == str(task["answer"])
    coordination = 1.0 - 0.25 * (rounds - 1) if correct else 0.0
    call_rewards = {call: 0.5 * right + 0.5 * coordination for call, right in calls.items()}
    quality = sum(calls.values()) / len(calls)
    components = {"quality": quality, "coordination": coordination, "correct": float(correct)}
    reward = sum(call_rewards.values()) / len(call_rewards)
    body = {"reward": reward, "components": {**components, "rounds": rounds}}
    run.post(trace, "reward", {**body, "call_rewards": call_rewards})
    return components


def agent(run: Run, temperature: float, outcomes: list[dict], failures: list[str]) -> None:
    try:
        while (work := run.next_task()) is not None:
            try:
                outcomes.append(play(run, work, temperature))
            except (NotFoundError, ConflictError):  # the run no longer knows the trace
                continue
            except urllib.error.HTTPError as err:
                if err.code not in (404, 409):
                    raise
            except (urllib.error.URLError, ConnectionError):  # it went away mid-trace
                continue
    except Exception as err:  # reported by main
        failures.append(f"{type(err).__name__}: {err}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the run's agent endpoint, as the job printed it")
    parser.add_argument("--agents", type=int, default=8, help="tasks played at once")
    parser.add_argument("--temperature", type=float, default=1.0, help="of every call")
    args = parser.parse_args()
    run = Run(args.url, os.environ["RLRAY_AGENT_TOKEN"])
    outcomes: list[dict] = []
    failures: list[str] = []
    threads = [
        threading.Thread(target=agent, args=(run, args.temperature, outcomes, failures))
        for _ in range(args.agents)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    means = {k: sum(o[k] for o in outcomes) / max(len(outcomes), 1) for k in COMPONENTS}
    shown = ", ".join(f"{k} {v:.3f}" for k, v in means.items())
    print(f"solve_and_check: {len(outcomes)} tasks, {shown}")
    for failure in failures:
        print(f"solve_and_check: an agent stopped: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
