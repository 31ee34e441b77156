"""Experiment tracking: each metrics.jsonl record to TensorBoard, and to wandb when asked.

TensorBoard event files are always written (under `<run_dir>/tensorboard/`, offline, no
account); wandb is optional. Both get the same flat tags, grouped so that TensorBoard shows
related curves side by side: `reward/mean`, `reward/components/<name>`, `loss/policy`,
`eval/accuracy`, ... (see `TAGS`). Numeric fields without a tag land in `other/<field>`, so
a new metric shows up without a change here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import yaml
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

from rlray.observe.event_file import EventFile

TAGS: dict[str, str] = {
    "reward_mean": "reward/mean",
    "reward_components": "reward/components",
    "reward_failures": "reward/failures",
    "reward_seconds": "reward/seconds",
    "reward_wait_seconds": "reward/wait_seconds",
    "eval_accuracy": "eval/accuracy",
    "eval": "eval",  # eval/<reward or component>/<metric>, e.g. eval/reward/pass@4
    "eval_stderr": "eval_stderr",
    "eval_prompts_left_out": "eval/prompts_left_out",
    "policy_loss": "loss/policy",
    "value_loss": "loss/value",
    "kl": "ppo/kl",
    "entropy": "ppo/entropy",
    "clip_fraction": "ppo/clip_fraction",
    "value_clip_fraction": "ppo/value_clip_fraction",
    "explained_variance": "ppo/explained_variance",
    "grad_norm": "ppo/grad_norm",
    "advantage_abs_mean": "ppo/advantage_abs_mean",
    "zero_advantage_share": "ppo/zero_advantage_share",
    "truncated_share": "rollout/truncated_share",
    "prompts_generated": "rollout/prompts_generated",
    "dropped_uniform_groups": "rollout/dropped_uniform_groups",
    "dropped_uniform_episodes": "rollout/dropped_uniform_episodes",
    "rollout_logprob_diff_mean": "sync/rollout_logprob_diff_mean",
    "rollout_logprob_diff_max": "sync/rollout_logprob_diff_max",
    "rollout_ratio_outside_share": "sync/rollout_ratio_outside_share",
    "rollout_correction_weight_mean": "sync/rollout_correction_weight_mean",
    "episodes_without_logprobs": "sync/episodes_without_logprobs",
    "elapsed_seconds": "progress/elapsed_seconds",
    "phase_seconds": "time",
    "memory_gib": "progress/memory_gib",
    "episodes": "progress/episodes",
    "policy_version": "progress/policy_version",
    "rollout_tokens_per_s": "rollout/tokens_per_s",
    "completion_length_mean": "rollout/completion_length_mean",
    "learner_tokens_per_s": "learner/tokens_per_s",
    "learner_seconds": "learner/seconds",
    "buffer_depth": "buffer/depth",
    "dropped_stale": "buffer/dropped_stale",
    "staleness_mean": "buffer/staleness_mean",
    "weight_sync_seconds": "sync/seconds",
    "logprob_parity_error": "sync/logprob_parity_error",
    "worker_policy_versions": "sync/worker_policy_versions",
}
"""metrics.jsonl field -> tag (or tag prefix, for dict-valued fields)."""


def flatten_metrics(record: dict[str, Any]) -> dict[str, float]:
    """Returns the record's finite numbers by tag; dicts become `<tag>/<key>`.

    `step` is the x axis, not a metric. None, bools, strings (`checkpoint`) and NaN/inf
    are left out: a NaN would break TensorBoard's axis scaling and wandb's charts.
    """
    flat: dict[str, float] = {}
    for field, value in record.items():
        if field != "step":
            _add_numbers(flat, TAGS.get(field, f"other/{field}"), value)
    return flat


def _add_numbers(flat: dict[str, float], tag: str, value: Any) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _add_numbers(flat, f"{tag}/{key}", inner)
    elif _is_number(value) and math.isfinite(value):
        flat[tag] = float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def wandb_run_id(run_id: str) -> str:
    """Returns a wandb id that is the same for every (resumed) session of a run.

    wandb ids allow only a few characters and 64 of them; the hash keeps two runs whose
    names differ only in replaced characters apart.
    """
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:48]
    return f"{safe}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """Returns the config with only JSON types (paths and the like as strings)."""
    return json.loads(json.dumps(config, default=str))


class Trackers:
    """The run's trackers: TensorBoard always, wandb when `use_wandb`."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        run_id: str,
        use_wandb: bool,
        wandb_project: str = "rlray",
        wandb_mode: str | None = None,
    ):
        """`wandb_mode` ("online", "offline", "disabled") goes to `wandb.init(mode=...)`;
        None leaves it to wandb (the WANDB_MODE environment variable)."""
        config = plain_config(config)
        self.tensorboard = EventWriter(Path(run_dir) / "tensorboard")
        config_yaml = yaml.safe_dump(config, sort_keys=False)
        self.tensorboard.add_text("config", _markdown_code(config_yaml), step=0)
        self.wandb_run = None
        if use_wandb:
            self.wandb_run = _start_wandb(run_dir, config, run_id, wandb_project, wandb_mode)

    def log(self, record: dict[str, Any]) -> None:
        """Writes one metrics.jsonl record at its `step`."""
        step = int(record["step"])
        flat = flatten_metrics(record)
        for tag, value in flat.items():
            self.tensorboard.add_scalar(tag, value, step)
        self.tensorboard.flush()  # a step's curves readable while the run goes on
        if self.wandb_run is not None and flat:
            # wandb drops (with a warning) a step below the run's last one, so an online run
            # resumed from an earlier checkpoint does not get its repeated steps twice.
            self.wandb_run.log(flat, step=step)

    def summary(self, summary: dict[str, Any]) -> None:
        """Records the end-of-run summary (summary.json) as text, and in wandb's summary."""
        text = json.dumps(summary, indent=2, default=str)
        step = int(summary.get("steps", 0))
        self.tensorboard.add_text("summary", _markdown_code(text), step)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(json.loads(text))

    def close(self) -> None:
        """Flushes the event files and finishes the wandb run; safe to call twice."""
        self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
            # finish() only sends wandb's service process a message to close the run
            # (inform_finish) and returns: on a busy machine the .wandb file then held
            # its 7-byte header alone for a moment. teardown() waits for the service to
            # exit, so the file is complete when close returns.
            import wandb  # imported by _start_wandb already: no cost here

            wandb.teardown()


class EventWriter:
    """TensorBoard event files of scalars and text, made of tensorboard's protos
    (rlray.observe.event_file): torch's SummaryWriter would import torch into the driver
    (its memory held for the whole run) for the same records."""

    def __init__(self, log_dir: Path):
        self.file = EventFile(log_dir)
        self.closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._write(step, Summary.Value(tag=tag, simple_value=float(value)))

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text summary as TensorBoard's text plugin reads it: `<tag>/text_summary`."""
        plugin = SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()
        )
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        metadata = SummaryMetadata(plugin_data=plugin)
        self._write(
            step, Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor)
        )
        self.flush()

    def _write(self, step: int, value: Summary.Value) -> None:
        self.file.write(Event(wall_time=time.time(), step=step, summary=Summary(value=[value])))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if not self.closed:
            self.file.close()
            self.closed = True


def _markdown_code(text: str) -> str:
    # TensorBoard renders text as Markdown; an indented block keeps YAML/JSON verbatim.
    return "\n".join("    " + line for line in text.splitlines())


def _start_wandb(
    run_dir: Path, config: dict[str, Any], run_id: str, project: str, mode: str | None
) -> Any:
    # Imported here: wandb takes a second to import and most runs do not use it.
    import wandb

    return wandb.init(
        project=project,
        name=run_id,
        id=wandb_run_id(run_id),
        dir=str(run_dir),
        config=config,
        resume="allow",
        mode=mode,
    )
