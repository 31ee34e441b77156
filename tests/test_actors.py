"""The actors on a real Ray cluster: weight sync changes generation and keeps logprob
parity, stale batches never reach the learner, and a dead actor is reported by name."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import ray

from rlray.cluster.calls import ActorFailure, wait_for
from rlray.cluster.start import start_actors, start_ingest
from rlray.config import Config, IngestConfig, RewardSpec, validate
from rlray.config.command_line import parse_command_line
from rlray.driver.plan import plan_run
from rlray.driver.training import TrainingDriver
from rlray.episodes.buffer import BufferedBatch
from rlray.rewards.worker import RewardWorker
from rlray.rollout.worker import vllm_env
from tests.conftest import free_port
from tests.jobs_helper import SHORT_RUN
from tests.test_learner import plain_logprob_gap

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def system(ray_session, tmp_path_factory):
    config: Config = parse_command_line([*SHORT_RUN, "--buffer.max_staleness", "1"]).config
    config.run_dir = str(tmp_path_factory.mktemp("actors-run"))
    validate(config)
    plan = plan_run(config, None)
    actors = start_actors(config, plan.model_path, plan.run_id, None)
    yield plan, actors
    actors.kill()


def generate(actors, plan, first_index: int = 1000):
    """Returns the ref of 16 scored episodes of 4 prompts, made by rollout-0, via reward-0."""
    rows = [plan.prompts.row(first_index + i) for i in range(4)]
    episodes_ref, _ = actors.rollout[0].generate.options(num_returns=2).remote(rows, first_index)
    scored_ref, stats_ref = actors.reward[0].score.options(num_returns=2).remote(episodes_ref)
    wait_for(stats_ref, "reward-0", "score", 120)
    return scored_ref


def test_weight_sync_changes_generation_and_keeps_parity(system, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    plan, actors = system
    before = ray.get(generate(actors, plan))
    driver = TrainingDriver(plan, actors, version=0, prompt_cursor=0)
    for _ in range(2):
        driver.train_step()
    synced = driver.sync_weights()
    # Every rollout worker reports the learner's version loaded.
    assert ray.get(actors.learner.state.remote())["version"] == 2
    assert synced["weight_versions_loaded"] == dict.fromkeys(actors.rollout_names, 2)
    after = ray.get(generate(actors, plan))
    assert {e.policy_version for e in before} == {0}
    assert {e.policy_version for e in after} == {2}
    assert all(set(e.reward_components) == {"exact_match"} for e in after)  # the breakdown
    # Same prompts, same sampling seeds: only the weights differ.
    assert [e.rollout_logprobs for e in after] != [e.rollout_logprobs for e in before]
    # vLLM's logprobs are a plain transformers forward pass's of the weights it should
    # hold - the base model before, the learner's version 2 (saved by the learner,
    # loaded by transformers) after - and not of the weights it held before.
    saved = ray.get(actors.learner.save_checkpoint.remote(str(tmp_path), 0))
    base, learned = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for path in (plan.model_path, f"{saved}/policy")
    )
    assert plain_logprob_gap(base, before) <= 1e-4
    assert plain_logprob_gap(learned, after) <= 1e-4
    assert plain_logprob_gap(base, after) > 0.1
    driver.drain()


def test_a_sync_is_checked_on_its_steps_own_tokens_and_an_engine_left_behind_shows(system):
    # max_staleness 1: a training batch is a version old, so its own logprobs cannot show
    # a sync's parity. After each sync an engine that loaded the weights scores a few
    # episodes of the step's batch as a prompt (a prefill, no generation), as the
    # learner does.
    plan, actors = system
    learner, worker = actors.learner, actors.rollout[0]
    version = ray.get(learner.state.remote())["version"]
    driver = TrainingDriver(plan, actors, version=version, prompt_cursor=7000)

    def parity_now() -> float:
        return ray.get(worker.parity_gap.remote(learner.parity_sample.remote()))

    driver.train_step()
    driver.sync_weights()
    assert driver.clock.lap()["parity_check"] > 0  # the driver checked this sync
    assert driver.weights.last_gap <= 1e-4  # what the next step reports
    assert parity_now() <= 1e-4  # and so does this test: the same episodes, both sides
    for _ in range(2):
        driver.train_step()  # the learner moves on; the engines keep the synced weights
    assert parity_now() > 1e-2
    driver.sync_weights()
    assert parity_now() <= 1e-4
    driver.drain()


def test_a_sync_may_start_the_next_step_which_trains_while_the_workers_load(system):
    # learner.overlap_sync: the learner runs its calls in order, so the next step asked
    # for after the publish cannot change what is published.
    plan, actors = system
    version = ray.get(actors.learner.state.remote())["version"]
    driver = TrainingDriver(plan, actors, version=version, prompt_cursor=8000)
    driver.sync_weights()
    driver.train_step()  # with max_staleness 1 the next batch is made meanwhile
    assert driver.overlaps_sync()
    synced = driver.sync_weights(start_next=True)
    assert driver.next_step is not None  # started before the loads were waited for
    # The workers hold the step's own weights, not the next step's, and the check
    # compared them with the learner's of that version.
    assert synced["weight_versions_loaded"] == dict.fromkeys(actors.rollout_names, version + 1)
    assert driver.weights.last_gap <= 1e-4
    metrics = driver.train_step()  # the started step, waited for
    assert metrics["step"] == version + 2 and driver.next_step is None
    assert metrics["logprob_parity_error"] <= 1e-4
    driver.drain()


def _start_environment(actor) -> dict[str, str]:
    """Returns the environment the actor's process started with (what glibc read)."""
    with open("/proc/self/environ", "rb") as environ:
        raw = environ.read()
    pairs = (item.decode().partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def test_rollout_actors_start_with_the_vllm_and_allocator_settings(system):
    _, actors = system
    # glibc reads its malloc settings once, at process start; set later they do nothing.
    started_with = ray.get(actors.rollout[0].__ray_call__.remote(_start_environment), timeout=60)
    expected = vllm_env(Config().rollout)
    assert int(started_with["MALLOC_MMAP_THRESHOLD_"]) >= 2**30
    assert {key: started_with.get(key) for key in expected} == expected


def _compiled_frames(actor) -> int:
    """Returns how many frames torch.compile (dynamo) compiled in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


def test_an_eager_cpu_engine_compiles_nothing_for_its_logprobs(system):
    # vLLM's sampler compiles its rank helper at the first call that asks for logprobs
    # unless torch.compile is off (1.8-15 s; rlray/rollout/worker.py: vllm_env).
    _, actors = system
    (made,) = ray.get(actors.rollout[0].complete.remote([5, 6, 7], 1, 1.0, 2, []), timeout=120)
    assert len(made.logprobs) == len(made.token_ids) > 0
    assert ray.get(actors.rollout[0].__ray_call__.remote(_compiled_frames), timeout=60) == 0


def appended(store) -> int:
    """Returns how many episodes the store actor took, written to files or not yet."""
    stats = ray.get(store.store_stats.remote(), timeout=60)
    return stats.episodes_written + stats.buffered


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_between_the_buffer_take_and_its_record_loses_no_batch(system, monkeypatch):
    # Before the stale-batch test, which leaves a dropped batch for the next take.
    plan, actors = system
    version = ray.get(actors.learner.state.remote())["version"]
    driver = TrainingDriver(plan, actors, version=version, prompt_cursor=6000)
    driver.sync_weights()  # the workers hold the learner's version: no batch is stale
    before = appended(actors.store)
    buffer_call = driver.buffer_call

    def take_then_ctrl_c(call, what):
        # The worst moment: the buffer handed the batches over, the driver has not
        # recorded them yet.
        result = buffer_call(call, what)
        if what == "take" and result is not None:
            ctrl_c()
        return result

    monkeypatch.setattr(driver, "buffer_call", take_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        driver.train_step()
    monkeypatch.undo()
    assert driver.training, "the Ctrl-C acted before the taken batches were recorded"
    started = driver.rollouts.tally.prompts_generated * plan.config.rollout.samples_per_prompt
    driver.drain()  # what the job does after a Ctrl-C
    assert appended(actors.store) - before == started


def test_a_ctrl_c_as_a_store_write_goes_out_neither_loses_nor_doubles_it(system, monkeypatch):
    plan, actors = system
    version = ray.get(actors.learner.state.remote())["version"]
    driver = TrainingDriver(plan, actors, version=version, prompt_cursor=0)
    scored = generate(actors, plan, first_index=4000)
    before = appended(actors.store)
    submit = driver.store.submit

    def ctrl_c_then_submit(key, write):
        ctrl_c()
        submit(key, write)

    monkeypatch.setattr(driver.store, "submit", ctrl_c_then_submit)
    with pytest.raises(KeyboardInterrupt):
        driver.store.write([[scored]], trained_at=None)
    monkeypatch.undo()
    driver.drain()
    assert appended(actors.store) - before == 16
    assert driver.store.pending == {}


def test_stale_batches_are_dropped_before_the_learner_sees_them(system):
    plan, actors = system
    version = ray.get(actors.learner.state.remote())["version"]
    old = generate(actors, plan, first_index=2000)  # made by the current rollout weights
    worker_version = ray.get(old)[0].policy_version
    buffer = actors.buffer
    before = ray.get(buffer.stats.remote())["dropped_stale"]
    assert ray.get(buffer.reserve.remote(16))
    ray.get(buffer.add.remote(BufferedBatch([old], worker_version, 16, 2000, batch_id=999)))
    # The learner moves two versions ahead (K=1) on fresh episodes.
    for _ in range(version - worker_version, 2):
        fresh = generate(actors, plan, first_index=3000)
        ray.get(actors.learner.train_on.remote([[fresh]], 60))
    learner_version = ray.get(actors.learner.state.remote())["version"]
    assert learner_version - worker_version == 2
    assert ray.get(buffer.take.remote(16, learner_version)) is None
    stats = ray.get(buffer.stats.remote())
    assert stats["dropped_stale"] - before == 16
    assert stats["buffer_depth"] == 0


SLOW_REWARD = """
import time


def slow_exact(prompts, completions, answer, **kwargs):
    time.sleep(5)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def test_rollout_worker_generates_while_a_slow_reward_scores(system, tmp_path):
    plan, actors = system
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    slow_spec = RewardSpec(name=f"{tmp_path}/slow.py:slow_exact")
    slow_scorer = ray.remote(RewardWorker).options(num_cpus=0).remote("reward-slow", [slow_spec])
    version = ray.get(actors.learner.state.remote())["version"]
    slow_actors = dataclasses.replace(actors, reward=[slow_scorer], reward_names=["reward-slow"])
    driver = TrainingDriver(plan, slow_actors, version=version, prompt_cursor=5000)
    driver.fill()
    first = driver.rollouts.in_flight[0]
    while first.generated is None:
        driver.rollouts.wait()  # returns once generation is done; scoring goes on
    driver.fill()
    assert [item.worker_index for item in driver.rollouts.in_flight] == [0, 0]
    second = driver.rollouts.in_flight[1]
    # rollout-0 started the next batch while reward-slow still scores the first.
    assert ray.wait([first.score_stats], timeout=0)[0] == []
    assert ray.get(second.generate_stats).policy_version == first.generated.policy_version
    driver.drain()
    ray.kill(slow_scorer)


def test_a_rollout_worker_that_dies_before_a_sync_loads_the_weights_when_restarted(system):
    plan, actors = system
    version = ray.get(actors.learner.state.remote())["version"]
    driver = TrainingDriver(plan, actors, version=version, prompt_cursor=0)
    ray.kill(actors.rollout[0], no_restart=False)  # Ray restarts it with the base model
    synced = driver.sync_weights()
    assert synced["weight_sync"] == "object_store"
    assert synced["weight_versions_loaded"] == {"rollout-0": version}
    assert driver.recovery.restarts == {"rollout-0": 1}
    assert {e.policy_version for e in ray.get(generate(actors, plan, first_index=7000))} == {
        version
    }


def post(url: str, episodes: list[dict]) -> tuple[int, dict, dict]:
    """POSTs episodes; returns the status, the JSON answer and the headers."""
    request = urllib.request.Request(
        url, data=json.dumps({"episodes": episodes}).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.replace("/episodes", "/health"), timeout=2):
            return True
    except OSError:
        return False


def test_the_ingestion_endpoint_comes_back_and_a_retry_stores_nothing_twice(system, tmp_path):
    """SIGKILL of the endpoint's process: Ray restarts it on the same host and port, and
    a client's retry of a POST it had answered is a duplicate; while the buffer it
    queues into restarts, a POST is answered 503 with Retry-After."""
    plan, actors = system
    config = dataclasses.replace(
        plan.config, ingest=IngestConfig(enabled=True, port=free_port(), train=True)
    )
    url = start_ingest(config, actors, plan.model_path, str(tmp_path), 120)
    posted = [
        {"run_id": "outside", "episode_id": f"kept-{i}", "prompt": "1+1=", "completion": "2"}
        for i in range(2)
    ]
    posted = [{**episode, "reward": 1.0} for episode in posted]  # queued for training
    assert post(url, posted)[:2] == (200, {**ANSWER, "accepted": 2, "queued_for_training": 2})
    before = ray.get(actors.ingest.__ray_call__.remote(lambda _: os.getpid()))
    os.kill(before, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not serving(url):
        assert time.monotonic() < deadline, "the endpoint did not come back"
        time.sleep(0.5)
    assert ray.get(actors.ingest.__ray_call__.remote(lambda _: os.getpid())) != before
    # The client never saw the answer, say, and retries: stored once, not twice.
    assert post(url, posted)[:2] == (200, {**ANSWER, "duplicates": 2})
    assert actors.restart_counts()["ingest"] == 1
    # The buffer restarts empty and refuses calls until restored (the driver's job).
    killed = ray.get(actors.buffer.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(actors.buffer, no_restart=False)
    wait_until_restarted(actors.buffer, "buffer", killed)
    fresh = [{**posted[0], "episode_id": "after-buffer-restart"}]
    status, answer, headers = post(url, fresh)
    assert (status, headers["Retry-After"]) == (503, "5"), answer
    assert "restarting" in answer["error"] and answer["error"].endswith("; retry")
    ray.get(actors.buffer.restore.remote([], 0))
    assert post(url, fresh)[:2] == (200, {**ANSWER, "accepted": 1, "queued_for_training": 1})
    ray.kill(actors.ingest, no_restart=True)
    actors.ingest = None
    assert [b.num_episodes for b in ray.get(actors.buffer.drain.remote())] == [1]


ANSWER = {"accepted": 0, "duplicates": 0, "scored": 0, "queued_for_training": 0}


def wait_until_restarted(handle, name: str, killed_pid: int, timeout_s: float = 120) -> None:
    """Waits until an actor Ray is restarting answers from a process other than the
    killed one (ray.kill returns before that one is gone, and calls made meanwhile fail
    with "temporarily unavailable"), as the driver's recovery does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid = wait_for(handle.__ray_call__.remote(lambda _: os.getpid()), name, "restart", 30)
            if pid != killed_pid:
                return
            assert time.monotonic() < deadline, f"{name} was not restarted"
        except ActorFailure as failure:
            if not failure.restarting or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def test_dead_rollout_actor_is_named(system):
    plan, actors = system
    driver = TrainingDriver(
        plan, actors, version=ray.get(actors.learner.state.remote())["version"], prompt_cursor=0
    )
    driver.weights.worker_versions = [driver.learner_version]
    ray.kill(actors.rollout[0], no_restart=True)
    with pytest.raises(ActorFailure, match="rollout-0") as failure:
        driver.train_step()
    message = str(failure.value)
    assert "\n" not in message
    assert "rollout-0 died during generate: " in message
    assert "ray.kill" in message  # the actor's last error, as Ray reported it
