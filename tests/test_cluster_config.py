"""The cluster launcher configs and the Grafana dashboard, checked against what reads them.

cluster.yaml and cluster-local.yaml go through the steps of `ray up` that need no cloud
credentials: Ray's `prepare_config` (merges the provider's defaults.yaml, as `ray up`
does) and `validate_config` (Ray's own ray-schema.json, then its cross-field rules).
Everything else they name in this repository (paths, the job command, the pip extra) is
checked against the repository itself. The dashboard is checked for what Grafana's
import needs and for the metric names Ray's Prometheus exporter gives rlray's metrics.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from rlray.cluster import telemetry
from rlray.config import validate
from rlray.config.command_line import parse_command_line

REPO = Path(__file__).resolve().parent.parent
CLUSTER_FILES = ["cluster.yaml", "cluster-local.yaml"]
DASHBOARD = REPO / "grafana" / "rlray-dashboard.json"

# The metrics rlray defines (rlray/cluster/telemetry.py): name -> (kind, tags). The dashboard
# is checked against this one list.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    name: (kind, tags) for name, (kind, _, tags) in telemetry.METRICS.items()
}
# Ray prefixes every custom metric with `ray_`; Prometheus adds `_total` to counters and
# splits a histogram into `_bucket` (with the `le` label), `_sum` and `_count`.
PROMETHEUS_SUFFIXES = {
    "gauge": [""],
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count"],
}
ROWS = ["Rollout", "Buffer", "Rewards", "Learner", "Weight sync"]
RUN_FILTER = 'run_id=~"$run_id"'


def load_cluster(name: str) -> dict[str, Any]:
    """Returns the cluster config as `ray up` reads it (yaml.safe_load)."""
    return yaml.safe_load((REPO / name).read_text())


def prepared_and_validated(config: dict[str, Any]) -> dict[str, Any]:
    """Returns the config after Ray's prepare_config; raises what validate_config raises."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def comment_text(name: str) -> str:
    """Returns the YAML file's comments, shell line continuations joined."""
    lines = (REPO / name).read_text().splitlines()
    comments = [line.strip()[1:].strip() for line in lines if line.strip().startswith("#")]
    return re.sub(r"\s*\\\n\s*", " ", "\n".join(comments))


def all_commands(config: dict[str, Any]) -> list[str]:
    """Returns every shell command the launcher runs on the nodes."""
    keys = ["setup_commands", "head_start_ray_commands", "worker_start_ray_commands"]
    return [command for key in keys for command in config.get(key, [])]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_config_passes_rays_own_validation(name):
    prepared = prepared_and_validated(load_cluster(name))
    assert prepared["cluster_name"].startswith("rlray")


def test_aws_cluster_has_a_cpu_head_and_scalable_gpu_workers():
    prepared = prepared_and_validated(load_cluster("cluster.yaml"))
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    (gpu,) = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    assert (gpu["min_workers"], gpu["max_workers"]) == (0, 4)
    assert prepared["max_workers"] >= gpu["max_workers"]


BREAKAGES = {
    "misspelled top-level key": lambda c: c.update(setup_comands=c.pop("setup_commands")),
    "min_workers as a string": lambda c: c["available_node_types"]["gpu"].update(min_workers="0"),
    "GPU count as a string": lambda c: c["available_node_types"]["gpu"]["resources"].update(
        GPU="1"
    ),
    "node type without node_config": lambda c: c["available_node_types"]["gpu"].pop("node_config"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_cluster_config_fails_validation(breakage):
    config = load_cluster("cluster.yaml")
    BREAKAGES[breakage](config)
    with pytest.raises(jsonschema.ValidationError):
        prepared_and_validated(config)


def test_broken_local_cluster_config_fails_validation():
    config = load_cluster("cluster-local.yaml")
    config["file_mount"] = config.pop("file_mounts")
    with pytest.raises(jsonschema.ValidationError, match="file_mount"):
        prepared_and_validated(config)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_config_names_only_paths_that_exist(name):
    config = load_cluster(name)
    sources = list(config["file_mounts"].values()) + config.get("rsync_filter", [])
    sources = [path for path in sources if not path.startswith("~/")]  # the user's files
    # Repository files the comments and commands mention (remote paths start with / or ~/).
    mentioned = re.findall(
        r"(?<![\w./~$-])[\w-]+(?:/[\w.-]+)*\.(?:py|toml|json|yaml|md)\b",
        (REPO / name).read_text(),
    )
    assert "jobs/ppo.py" in mentioned
    missing = [path for path in sources + mentioned if not (REPO / path).exists()]
    assert not missing, f"{name} names paths missing from the repository: {missing}"


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_documented_job_command_parses_with_rlray_config(name):
    commands = re.findall(r"ray job submit .*? -- python (.+)", comment_text(name))
    assert commands, f"{name} documents no `ray job submit ... -- python ...`"
    for command in commands:
        script, *args = shlex.split(command)
        assert (REPO / script).is_file(), script
        validate(parse_command_line(args).config)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_setup_installs_the_mounted_repo_with_a_defined_extra(name):
    config = load_cluster(name)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installs = [
        match
        for command in config["setup_commands"]
        for match in re.findall(r"pip install -e \"\$HOME/([\w/]+)\[(\w+)\]\"", command)
    ]
    assert installs == [("rlray", "gpu")]
    (directory, extra) = installs[0]
    assert extra in extras
    # The whole repository, or what pip needs of it: pyproject.toml, its readme, the package.
    mounts = config["file_mounts"]
    needed = {f"~/{directory}/{path}": path for path in ("pyproject.toml", "README.md", "rlray")}
    assert f"~/{directory}" in mounts or needed.items() <= mounts.items(), mounts


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_cluster_commands_are_valid_shell(name):
    commands = all_commands(load_cluster(name))
    assert any("ray start --head" in command for command in commands)
    assert any("ray start --address=$RAY_HEAD_IP:6379" in command for command in commands)
    for command in commands:
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, f"{command!r}: {result.stderr}"


# --- the Grafana dashboard ---------------------------------------------------------------


def load_dashboard() -> dict[str, Any]:
    """Returns the dashboard JSON as Grafana's import reads it."""
    return json.loads(DASHBOARD.read_text())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """Returns the PromQL of every panel target."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def prometheus_names() -> dict[str, str]:
    """Returns {Prometheus series name: rlray metric name} for every metric in METRICS."""
    return {
        f"ray_{name}{suffix}": name
        for name, (kind, _) in METRICS.items()
        for suffix in PROMETHEUS_SUFFIXES[kind]
    }


def test_dashboard_has_what_grafana_import_needs():
    dashboard = load_dashboard()
    assert (dashboard["title"], dashboard["uid"]) == ("rlray", "rlray")
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "run_id"} <= set(variables), list(variables)
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    run_query = re.fullmatch(
        r"label_values\((\w+), run_id\)", variables["run_id"]["query"]["query"]
    )
    assert run_query and run_query[1] in prometheus_names(), variables["run_id"]["query"]

    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"], panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in load_dashboard()["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        for x in range(box["x"], box["x"] + box["w"]):
            for y in range(box["y"], box["y"] + box["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_dashboard_shows_every_rlray_metric():
    text = "\n".join(exprs(load_dashboard()))
    for name, (kind, _) in METRICS.items():
        # A histogram is shown from its buckets; gauges and counters by their one series.
        series = f"ray_{name}{PROMETHEUS_SUFFIXES[kind][0]}"
        assert re.search(rf"\b{series}\{{", text), f"no panel shows {name} ({series})"


def test_dashboard_queries_name_real_series_filtered_by_run():
    known = prometheus_names()
    for expr in exprs(load_dashboard()):
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        selectors = re.findall(r"\b(ray_\w+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for series, matchers in selectors:
            assert series in known, f"{series} is no series of rlray's metrics: {expr}"
            assert RUN_FILTER in matchers, f"{series} not filtered by run: {expr}"
            tags = {*METRICS[known[series]][1], *(["le"] if series.endswith("_bucket") else [])}
            labels = set(re.findall(r"(\w+)\s*[=!]~?", matchers))
            assert labels <= tags, f"{series} has no label {labels - tags}: {expr}"


def test_counters_are_shown_as_rates_and_worker_series_by_worker():
    counters = [f"ray_{n}_total" for n, (kind, _) in METRICS.items() if kind == "counter"]
    panels = [p for p in load_dashboard()["panels"] if p["type"] == "timeseries"]
    for target in [t for p in panels for t in p["targets"]]:
        expr = target["expr"]
        for counter in counters:
            if counter in expr:
                assert re.search(rf"rate\({counter}\{{[^}}]*\}}\[1m\]\)", expr), expr
        if "by (worker)" in expr:
            assert target["legendFormat"] == "{{worker}}", expr
