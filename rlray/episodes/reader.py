"""Reading an episode store back: `rlray.episodes.read(path_or_s3_uri)` and a summary.

    import rlray.episodes
    table = rlray.episodes.read("runs/exp1/episodes")          # or "s3://bucket/prefix"
    table.to_pandas()                                           # if pandas is installed

The table has the columns of rlray.core.episode.EPISODE_SCHEMA, one row per episode, from
every run and date under the path (filter with `runs=[...]`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from rlray.core.episode import EPISODE_SCHEMA, Episode, Span, from_table
from rlray.core.groups import AGENT_TRACE_COLUMN


def read(
    source: str | Path, runs: list[str] | None = None, endpoint_url: str | None = None
) -> pa.Table:
    """Returns every episode stored under a local directory or an s3:// URI as a Table
    with EPISODE_SCHEMA (rows of `runs` only, if given). Raises FileNotFoundError if the
    source holds no episode file."""
    filesystem, path = _filesystem(str(source), endpoint_url)
    partition_fields = pa.schema([("run", pa.string()), ("date", pa.string())])
    dataset = ds.dataset(
        path,
        # Every file read as today's schema: a column that older files lack (the
        # completion_mask of schema version 2) reads as null there.
        schema=pa.unify_schemas([EPISODE_SCHEMA, partition_fields]),
        format="parquet",
        filesystem=filesystem,
        partitioning=ds.partitioning(partition_fields, flavor="hive"),
        exclude_invalid_files=True,
        ignore_prefixes=[".", "_"],
    )
    if not dataset.files:
        raise FileNotFoundError(f"no episode files under {source}")
    table = dataset.to_table(filter=pc.field("run").isin(runs) if runs else None)
    return table.select(EPISODE_SCHEMA.names).cast(EPISODE_SCHEMA)


def _filesystem(source: str, endpoint_url: str | None) -> tuple[Any, str]:
    if source.startswith("s3://"):
        # S3 support loads the AWS SDK: only an s3:// store needs it
        from pyarrow import fs

        # Credentials from the standard AWS chain, as boto3 uses them.
        return fs.S3FileSystem(endpoint_override=endpoint_url), source.removeprefix("s3://")
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such episode store: {source}")
    return None, str(path)


def summarize(table: pa.Table) -> dict[str, Any]:
    """Returns counts, reward mean by policy version, finish reasons and reward
    failures (components without a value) of a table of episodes."""
    rows = table.select(
        ["run_id", "policy_version", "reward", "reward_components", "finish_reason", "trained_at"]
    ).to_pylist()
    by_version: dict[int, list[float]] = defaultdict(list)
    failures: Counter[str] = Counter()
    for row in rows:
        if row["reward"] is not None:
            by_version[row["policy_version"]].append(row["reward"])
        failures.update(name for name, value in row["reward_components"] or [] if value is None)
    return {
        "episodes": len(rows),
        "runs": sorted({row["run_id"] for row in rows}),
        "trained": sum(row["trained_at"] is not None for row in rows),
        "without_reward": sum(row["reward"] is None for row in rows),
        "reward_mean_by_policy_version": {
            version: sum(values) / len(values) for version, values in sorted(by_version.items())
        },
        "finish_reasons": dict(Counter(row["finish_reason"] for row in rows).most_common()),
        "reward_failures": dict(failures.most_common()),
    }


def find_episode(table: pa.Table, episode_id: str) -> Episode | None:
    """Returns the stored episode with that id, None if there is none. An agent trace's
    later episodes get the trace's spans, which only its first episode stores."""
    rows = table.filter(pc.equal(table["episode_id"], episode_id))
    if rows.num_rows == 0:
        return None
    episode = from_table(rows)[0]
    trace_id = episode.columns.get(AGENT_TRACE_COLUMN)
    if trace_id is not None and not episode.spans:
        sample = table.filter(
            pc.and_(
                pc.equal(table["run_id"], episode.run_id),
                pc.and_(
                    pc.equal(table["prompt_index"], episode.prompt_index),
                    pc.equal(table["sample_index"], episode.sample_index),
                ),
            )
        )
        for other in from_table(sample):
            if other.columns.get(AGENT_TRACE_COLUMN) == trace_id and other.spans:
                episode.spans = other.spans
                break
    return episode


def format_trace(episode: Episode) -> str:
    """Returns an episode's trace turn by turn: its prompt, then each span (model turns,
    tool calls with arguments, result or error and latency, rewards), or its completion
    where it has none; then each reward component's score, with its explanation where
    the reward gave one (code_tests: each test's verdict)."""
    lines = [
        f"episode {episode.episode_id} (run {episode.run_id}, policy v{episode.policy_version}, "
        f"finish {episode.finish_reason}, reward {episode.reward})",
        f"prompt: {episode.prompt!r}",
    ]
    for span in episode.spans:
        lines.append("  " + _span_line(span))
    policy = sum(episode.completion_mask) if episode.completion_mask else None
    tokens = len(episode.completion_token_ids)
    if policy is not None:
        lines.append(
            f"completion: {tokens} tokens ({policy} the policy's, {tokens - policy} appended)"
        )
    elif not episode.spans:
        lines.append(f"completion: {episode.completion!r}")
    for name, value in episode.reward_components.items():
        detail = episode.reward_details.get(name)
        lines.append(f"  {name} = {value}" + (f": {detail}" if detail is not None else ""))
    return "\n".join(lines)


def _span_line(span: Span) -> str:
    took = f"{span.ended_at - span.started_at:6.3f} s" if span.ended_at is not None else " " * 8
    if span.kind == "model_call":
        role = f"{span.name}: " if span.name else ""
        return f"model_call {took}  {role}{span.output!r}"
    if span.kind == "tool_call":
        outcome = f"error: {span.error}" if span.error is not None else repr(span.result)
        return f"tool_call  {took}  {span.name} {span.arguments} -> {outcome}"
    if span.kind == "event":
        value = "" if span.value is None else f" = {span.value}"
        return f"event      {span.name} {span.output!r}{value}"
    return f"reward     {span.source}: {span.value}"
