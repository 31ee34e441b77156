"""From a config's reward specs to callables: built-in names, import paths, schedules.

A spec's `name` is a built-in (the table below) or an import path, "pkg.module:attr" or
"path/to/file.py:attr". The target is a function, called on every batch with the spec's
kwargs, or a class, constructed once per reward worker with the kwargs (model-based
rewards load their model there) and then called on every batch. Either way the call is
TRL's: `reward(prompts=[...], completions=[...], **columns) -> list[float | None]`.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlray.config import ConfigError, RewardSpec

RewardFn = Callable[..., list[float | None]]

# Built-in rewards, resolved like any user import path (and imported only when used).
TEXT_REWARDS = (
    "exact_match",
    "normalized_match",
    "numeric_match",
    "regex_match",
    "length_reward",
    "overlong_penalty",
    "repetition_penalty",
    "distinct_n",
    "script_diversity",
    "lexicon_sentiment",
    "bleu",
    "chrf",
)
TRACE_REWARDS = ("environment_reward", "tool_success")
BUILTIN_REWARDS: dict[str, str] = {
    **{name: f"rlray.rewards.text:{name}" for name in TEXT_REWARDS},
    **{name: f"rlray.rewards.trace:{name}" for name in TRACE_REWARDS},
    "code_tests": "rlray.rewards.code:code_tests",
    "reasoning_gym": "rlray.rewards.libraries:reasoning_gym",
    "math_verify": "rlray.rewards.libraries:math_verify",
    "embedding_similarity": "rlray.rewards.model_based:EmbeddingSimilarity",
    "classifier_reward": "rlray.rewards.model_based:ClassifierReward",
}

# Built-ins called in the scorer's own process, without the child process that guards
# against user code (rlray.rewards.process): ours, no model, linear in their input.
# regex_match is left out (its pattern is the user's and can backtrack for ever: the
# child's timeout stops it), as are code_tests (it runs code), the model rewards and the
# libraries' (their code, and math-verify's time limits need a main thread).
IN_PROCESS_REWARDS = frozenset(TEXT_REWARDS + TRACE_REWARDS) - {"regex_match"}


@dataclass
class LoadedReward:
    """One reward component, ready to call."""

    name: str
    """The spec's name: the component's key in episodes and metrics."""
    fn: RewardFn
    kwargs: dict[str, Any]
    """Passed on every call (empty for classes: they got theirs at construction)."""
    spec: RewardSpec


def scheduled_weight(spec: RewardSpec, step: int) -> float:
    """Returns the weight of `spec` at `step`: constant without a schedule; else held
    before the first and after the last point, linear or stepwise in between."""
    if not spec.schedule:
        return spec.weight
    steps = [point[0] for point in spec.schedule]
    weights = [point[1] for point in spec.schedule]
    right = bisect.bisect_right(steps, step)
    if right == 0:
        return weights[0]
    if right == len(steps) or spec.interpolation == "step":
        return weights[right - 1]
    left = right - 1
    share = (step - steps[left]) / (steps[right] - steps[left])
    return weights[left] + share * (weights[right] - weights[left])


def absolute_spec_path(spec: RewardSpec, base: Path) -> RewardSpec:
    """Returns the spec with a relative "file.py:attr", and a relative `model_path`
    among its kwargs that names something under `base` (not a hub name), made absolute
    against `base`, so that reward actors (whose working directory may differ) find the
    same file and model."""
    target = BUILTIN_REWARDS.get(spec.name, spec.name)
    file_part, _, attr = target.rpartition(":")
    fields = dict(spec.__dict__)
    if file_part.endswith(".py") and not Path(file_part).is_absolute():
        fields["name"] = f"{(base / file_part).resolve()}:{attr}"
    model_path = spec.kwargs.get("model_path")
    relative = isinstance(model_path, str) and not Path(model_path).is_absolute()
    if relative and (base / model_path).exists():
        fields["kwargs"] = {**spec.kwargs, "model_path": str((base / model_path).resolve())}
    return RewardSpec(**fields)


def resolve_target(name: str) -> Any:
    """Returns the function or class a reward name points at; raises ValueError with a
    one-line reason."""
    target = BUILTIN_REWARDS.get(name, name)
    module_part, colon, attr = target.rpartition(":")
    if not colon or not module_part or not attr:
        known = ", ".join(sorted(BUILTIN_REWARDS))
        raise ValueError(f"unknown reward {name!r}: not a built-in ({known}) nor 'module:function'")
    return import_attribute(target)


# Where rlray's modules were before the package took a folder per role: a spec written
# against an old path ("rlray.environments:ToolEnvironment") still finds its target.
MOVED = {
    "rlray.calculator": "rlray.rollout.environments",
    "rlray.environments": "rlray.rollout.environments",
    "rlray.environments:tool_success": "rlray.rewards.trace",
    "rlray.multiturn": "rlray.rollout.multiturn",
    "rlray.tools": "rlray.rollout.tools",
    "rlray.rewards.model_rewards": "rlray.rewards.model_based",
}


def import_attribute(target: str) -> Any:
    """Returns the callable at "module:name" or "path/to/file.py:name"; raises ValueError
    with a one-line reason."""
    module_part, colon, attr = target.rpartition(":")
    if not colon or not module_part or not attr:
        raise ValueError(f"{target!r} is not 'module:name' nor 'path/to/file.py:name'")
    module_part = MOVED.get(target, MOVED.get(module_part, module_part))
    module = _import_file(module_part) if module_part.endswith(".py") else _import(module_part)
    if not hasattr(module, attr):
        raise ValueError(f"{module_part} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise ValueError(f"{target} is not callable")
    return obj


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as err:  # any import-time error of user code is a config error
        raise ValueError(f"cannot import {module_name}: {type(err).__name__}: {err}") from None


def _import_file(path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no such file: {path}")
    # A stable private module name per file: the same file loads once per process.
    module_name = (
        "rlray_user_rewards_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    )
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as err:
        raise ValueError(f"cannot import {path}: {type(err).__name__}: {err}") from None
    return module


def accepted_columns(fn: Callable[..., Any], columns: dict[str, Any]) -> dict[str, Any]:
    """Returns the columns `fn` takes: all of them if it has **kwargs (TRL's convention),
    else only those it names."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return columns
    names = {p.name for p in parameters}
    return {key: value for key, value in columns.items() if key in names}


def call_reward(reward: LoadedReward, arguments: dict[str, Any]) -> Any:
    """Calls the reward on one call's arguments: prompts, completions and `columns`, of
    which it gets those it takes."""
    columns = {key: value for key, value in arguments.items() if key != "columns"}
    columns |= accepted_columns(reward.fn, arguments["columns"])
    return reward.fn(**columns, **reward.kwargs)


def describe_failure(err: BaseException) -> str:
    """One line on how a reward call failed."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"raised {type(err).__name__}: {err}"


def check_callable(spec: RewardSpec, column_names: set[str]) -> None:
    """Raises ValueError if the reward cannot be called as configured: constructor
    kwargs of a class, or prompts/completions/columns/kwargs of a function."""
    target = resolve_target(spec.name)
    if inspect.isclass(target):
        _bind(target, spec.kwargs, "constructor")
        call = target.__call__
        columns = accepted_columns(call, {name: [] for name in column_names})
        _bind(call, {"self": None, "prompts": [], "completions": [], **columns}, "call")
        return
    columns = accepted_columns(target, {name: [] for name in column_names})
    _bind(target, {"prompts": [], "completions": [], **columns, **spec.kwargs}, "call")


def _bind(fn: Callable[..., Any], arguments: dict[str, Any], what: str) -> None:
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        raise ValueError(f"wrong signature for a reward {what}: {err}") from None


def load_reward(spec: RewardSpec) -> LoadedReward:
    """Returns the spec's reward ready to call (constructs a class once)."""
    target = resolve_target(spec.name)
    if inspect.isclass(target):
        return LoadedReward(spec.name, target(**spec.kwargs), {}, spec)
    return LoadedReward(spec.name, target, dict(spec.kwargs), spec)


def check_rewards(
    specs: list[RewardSpec],
    column_names: set[str],
    field: str = "reward.functions",
    data: str = "",
) -> None:
    """Raises ConfigError naming the first reward (as `field`[i]) that does not import or
    cannot be called with this data (`data` names it in the message) and these kwargs;
    loads no model."""
    names = [spec.name for spec in specs]
    for i, spec in enumerate(specs):
        if names.count(spec.name) > 1:
            raise ConfigError(f"{field}[{i}].name: {spec.name!r} appears twice")
        try:
            check_callable(spec, column_names)
        except ValueError as err:
            where = f" with {data}" if data else ""
            raise ConfigError(f"{field}[{i}].name ({spec.name}){where}: {err}") from None
