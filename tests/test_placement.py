"""Placement groups per role: the learner group's bundles, and a tensor-parallel rollout
worker's group of its own, whose GPU bundles its engine's rank workers (vLLM's Ray
executor, started from the actor) take. The second runs in a Ray of its own that
declares 2 logical GPUs (the session's cluster has none): Ray hands out GPU ids to the
rank tasks as it would on a GPU node; nothing here needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from rlray.cluster.placement import role_resources
from rlray.cluster.start import learners_build_while_engines_start
from rlray.config import Config
from tests.jobs_helper import REPO


def tensor_parallel_config() -> Config:
    config = Config()
    config.rollout.num_workers = 2
    config.rollout.gpus_per_worker = 2
    config.rollout.tensor_parallel_size = 2
    config.rollout.cpus_per_worker = 1.0
    config.learner.num_workers = 3
    config.learner.gpus = 1
    return config


def test_each_tensor_parallel_worker_gets_a_strict_pack_group_of_a_gpu_per_rank():
    roles = role_resources(tensor_parallel_config())
    ranks = [{"CPU": 1.0, "GPU": 1.0}, {"GPU": 1.0}]
    assert roles["rollout"].groups() == [(ranks, "STRICT_PACK"), (ranks, "STRICT_PACK")]
    # Learners: one group, a bundle per learner, packed onto as few nodes as fit.
    assert roles["learner"].groups() == [([{"CPU": 1.0, "GPU": 1.0}] * 3, "PACK")]
    config = Config()
    assert role_resources(config)["rollout"].groups() == [([{"CPU": 1.0}], "SPREAD")]


PROBE = textwrap.dedent(
    """
    import json, ray
    from ray.util import get_current_placement_group
    from rlray.cluster.placement import Placement, role_resources
    from tests.test_placement import tensor_parallel_config

    ray.init("local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    placement = Placement("probe")
    roles = role_resources(tensor_parallel_config())
    assert placement.reserve(roles["rollout"], timeout_s=60) is None

    @ray.remote(num_gpus=1, num_cpus=0)
    def rank():  # as vLLM's Ray executor starts a rank worker: a GPU, no CPU
        return ray.get_gpu_ids()[0], get_current_placement_group().id.hex()

    @ray.remote
    class Worker:  # stands for the rollout actor that owns the engine
        def ranks(self):
            group = get_current_placement_group().id.hex()
            return group, ray.get([rank.remote() for _ in range(2)]), ray.get_gpu_ids()

    workers = [
        Worker.options(**placement.actor_options("rollout", i)).remote() for i in range(2)
    ]
    found = ray.get([w.ranks.remote() for w in workers], timeout=60)
    groups = [g.id.hex() for g in placement.groups["rollout"]]
    print(json.dumps({"groups": groups, "found": found}))
    """
)


def without_ray_address(env: os._Environ) -> dict[str, str]:
    """The environment without RAY_ADDRESS: the probe starts a Ray of its own."""
    return {key: value for key, value in env.items() if key != "RAY_ADDRESS"}


def run_probe(source: str, tmp_path) -> dict:
    """Runs a probe script in a Ray of its own; returns the JSON of its last line."""
    script = tmp_path / "probe.py"
    script.write_text(source)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**without_ray_address(os.environ), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_tensor_parallel_workers_ranks_take_the_gpus_of_its_own_group(tmp_path):
    probe = run_probe(PROBE, tmp_path)
    used = set()
    found = zip(probe["groups"], probe["found"], strict=True)
    for group, (actor_group, ranks, actor_gpus) in found:
        assert actor_group == group and actor_gpus == []  # the actor holds no GPU itself
        assert [rank_group for _, rank_group in ranks] == [group, group]  # captured
        gpus = {gpu for gpu, _ in ranks}
        assert len(gpus) == 2  # a GPU per rank
        used |= gpus
    assert len(used) == 4  # the two workers' ranks share no GPU


def one_gpu_colocated_config() -> Config:
    """The one-GPU configuration docs/cluster.md shows: the learner and its engine on the
    same GPU, taking turns."""
    config = Config()
    config.ray.placement = "colocated"
    config.learner.gpus = config.rollout.gpus_per_worker = 1
    return config


def test_a_colocated_learner_and_engine_take_one_bundle_of_both_roles_cpus_and_the_gpu():
    from rlray.cluster.placement import colocated_resources
    from rlray.config import validate

    config = one_gpu_colocated_config()
    validate(config)
    assert colocated_resources(config).groups() == [([{"CPU": 2.0, "GPU": 1.0}], "PACK")]
    config.ray.placement = "disaggregated"  # the same roles apart need two GPUs
    roles = role_resources(config)
    assert [roles[role].groups()[0][0] for role in ("rollout", "learner")] == [
        [{"CPU": 1.0, "GPU": 1.0}],
        [{"CPU": 1.0, "GPU": 1.0}],
    ]


def test_a_colocated_group_takes_a_bundle_per_learner_with_its_engine():
    from rlray.cluster.placement import colocated_resources
    from rlray.config import validate

    config = one_gpu_colocated_config()
    config.learner.num_workers = config.rollout.num_workers = 2
    validate(config)
    # One group, packed: each rank's learner and engine share its one GPU.
    bundle = {"CPU": 2.0, "GPU": 1.0}
    assert colocated_resources(config).groups() == [([bundle, bundle], "PACK")]


ONE_GPU_PROBE = textwrap.dedent(
    """
    import json, ray
    from rlray.cluster.placement import Placement, colocated_resources, role_resources
    from tests.test_placement import one_gpu_colocated_config

    ray.init("local", num_cpus=3, num_gpus=1, include_dashboard=False, log_to_driver=False)
    config = one_gpu_colocated_config()
    placement = Placement("one-gpu")
    fits = [placement.reserve(role_resources(config)["reward"], timeout_s=60)]
    fits.append(placement.reserve(colocated_resources(config), timeout_s=60))

    @ray.remote
    class Colocated:  # stands for the colocated actor: a learner and its engine
        def gpus(self):
            return ray.get_gpu_ids()

    actor = Colocated.options(**placement.actor_options("learner", 0)).remote()
    gpus = ray.get(actor.gpus.remote(), timeout=60)
    placement.release()
    config.ray.placement = "disaggregated"
    apart = Placement("two-roles")
    problems = [apart.reserve(role_resources(config)[role], 5) for role in ("rollout", "learner")]
    print(json.dumps({"fits": fits, "gpus": gpus, "apart": problems}))
    """
)


def test_a_one_gpu_machine_places_the_colocated_run_and_not_the_disaggregated_one(tmp_path):
    probe = run_probe(ONE_GPU_PROBE, tmp_path)
    assert probe["fits"] == [None, None] and len(probe["gpus"]) == 1
    assert probe["apart"][0] is None  # the rollout worker takes the one GPU...
    assert probe["apart"][1].startswith("learner: no room within 5 s")  # ...and none is left


def test_the_one_gpu_line_of_the_docs_is_the_config_placed_above():
    from rlray.config import validate
    from rlray.config.command_line import parse_command_line

    page = (REPO / "docs" / "cluster.md").read_text()
    lines = [line for line in page.splitlines() if line.startswith("python jobs/ppo.py")]
    colocated = [line for line in lines if "--ray.placement colocated" in line]
    one_gpu = [line for line in colocated if "num_workers" not in line]
    assert len(one_gpu) == 1, lines
    config = parse_command_line(one_gpu[0].split()[2:]).config
    validate(config)
    wanted = one_gpu_colocated_config()
    assert (config.ray, config.learner, config.rollout) == (
        wanted.ray,
        wanted.learner,
        wanted.rollout,
    )


def test_the_eight_gpu_line_of_the_docs_gives_each_rank_a_gpu_and_each_engine_a_batch():
    from rlray.cluster.placement import colocated_resources
    from rlray.config import validate
    from rlray.config.command_line import parse_command_line

    page = (REPO / "docs" / "cluster.md").read_text()
    (line,) = [
        line
        for line in page.splitlines()
        if line.startswith("python jobs/ppo.py") and "--learner.num_workers 8" in line
    ]
    config = parse_command_line(line.split()[2:]).config
    validate(config)
    bundle = {"CPU": 2.0, "GPU": 1.0}
    assert colocated_resources(config).groups() == [([bundle] * 8, "PACK")]
    # Every engine generates a batch of every step.
    batches = config.learner.episodes_per_step // config.rollout_batch_episodes
    assert batches == config.rollout.num_workers == 8


def test_learners_build_while_engines_start_unless_both_are_on_gpus():
    config = Config()
    assert learners_build_while_engines_start(config)  # CPU: each on a core of its own
    config.learner.gpus = 1
    assert learners_build_while_engines_start(config)  # the engines on CPU
    # An engine measures its GPU's free memory as it starts; a learner may share the GPU
    # (fractional GPUs), so it builds after.
    config.rollout.gpus_per_worker = 0.5
    assert not learners_build_while_engines_start(config)
    assert not learners_build_while_engines_start(tensor_parallel_config())
