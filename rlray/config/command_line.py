"""The command line and YAML files: `jobs/*.py --help`, --config, --resume, overrides.

jsonargparse builds the parser from the schema's dataclasses and does the type checks;
this module adds --resume, accepts dashes in field names, and turns every parse error
into one line that names the field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import math
import re
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonargparse
import yaml
from jsonargparse import Namespace

from rlray.algorithms.estimators import ESTIMATORS
from rlray.algorithms.losses import POLICY_LOSSES
from rlray.config.schema import Config, ConfigError, did_you_mean, field_types

# jsonargparse builds the parser from the schema's dataclasses: their type hints, defaults
# and the string literal under each field (read by docstring-parser) as its --help text.
jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)

USAGE = (
    "%(prog)s [--config FILE.yaml | --resume RUN_DIR] [--model PATH] [--SECTION.FIELD VALUE ...]"
)
DESCRIPTION = """\
RL fine-tuning of a causal LM on Ray with vLLM rollouts.

Every field below can be set on the command line (--learner.lr 2e-5, or with dashes:
--learner.micro-batch-size 32) or in a YAML file of the same nesting (learner: {lr: 2e-5}).
Lists and mappings are YAML text: --reward.functions '[{name: exact_match, weight: 2.0}]'.
Precedence: defaults < --config file (or the resumed run's config.yaml) < command line."""


@dataclass
class CommandLine:
    """What the command line asked for: the config and, if any, a run to resume."""

    config: Config
    resume_dir: Path | None


def build_parser(prog: str | None = None) -> jsonargparse.ArgumentParser:
    """Returns the parser whose --help lists every config field with its doc, its default
    and, for Literal fields, the choices."""
    parser = jsonargparse.ArgumentParser(
        prog=prog,
        usage=USAGE,
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        exit_on_error=False,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="Load config from a YAML file; command-line fields override it.",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="Continue a stopped run from its last checkpoint, with its own config.yaml; "
        "command-line fields override it (e.g. --learner.steps 200 to run longer).",
    )
    parser.add_class_arguments(Config, as_group=False)
    # `--model PATH` is short for --model.path (parse_command_line rewrites it); the flag
    # jsonargparse made for it would load the model section from a file, which --config does.
    (shortcut,) = [action for action in parser._actions if action.option_strings == ["--model"]]
    shortcut.metavar, shortcut.help = "PATH", "Same as --model.path."
    _list_registered(parser, "--algorithm.advantage", _estimator_lines())
    _list_registered(parser, "--algorithm.policy_loss", _policy_loss_lines())
    return parser


def _list_registered(parser: jsonargparse.ArgumentParser, flag: str, lines: list[str]) -> None:
    """Appends what each registered choice of `flag` computes to its --help text."""
    (action,) = [action for action in parser._actions if flag in action.option_strings]
    action.help = f"{action.help} Choices: " + "; ".join(lines) + "."


def _estimator_lines() -> list[str]:
    return [
        f"{e.name} = {e.summary.rstrip('.')}" + (" [critic]" if e.needs_critic else "")
        for e in ESTIMATORS.values()
    ]


def _policy_loss_lines() -> list[str]:
    return [
        f"{p.name} = {p.summary.rstrip('.')} [clips {p.clip_low:g}, {p.clip_high:g}]"
        for p in POLICY_LOSSES.values()
    ]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, jsonargparse.DefaultHelpFormatter):
    """Prints the description as written; wraps field docs without breaking at hyphens
    (so `builtin:tiny-arithmetic` stays whole)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def parse_command_line(argv: list[str]) -> CommandLine:
    """Returns the config from defaults < --config file (or the resumed run's
    config.yaml) < command-line overrides. Raises ConfigError on any bad input."""
    parser = _shared_parser()
    argv = [_canonical(arg) for arg in argv]
    given = _checked(parser.parse_args, argv)
    resume_dir = Path(given.resume) if given.resume else None
    tree = None
    if resume_dir is not None:
        if given.config:
            raise ConfigError("--resume takes the run's own config.yaml; drop --config")
        if not (resume_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: no config.yaml in {resume_dir}")
        tree = {**load_yaml_file(resume_dir / "config.yaml"), "run_dir": str(resume_dir)}
    elif given.config:
        tree = load_yaml_file(given.config)
    if tree is not None:  # the file's values, then the command line's on top
        given = _checked(parser.parse_args, argv, namespace=_checked(parser.parse_object, tree))
    for f in dataclasses.fields(Config):
        section = dataclasses.is_dataclass(field_types(Config)[f.name])
        if section and not isinstance(given[f.name], Namespace):
            raise ConfigError(f"{f.name}: expected a section of fields, got {given[f.name]!r}")
    built = _checked(parser.instantiate, given)
    config = Config(**{f.name: built[f.name] for f in dataclasses.fields(Config)})
    if resume_dir is not None and Path(config.run_dir) != resume_dir:
        raise ConfigError("--resume and --run-dir name different directories")
    return CommandLine(config=config, resume_dir=resume_dir)


@functools.cache
def _shared_parser() -> jsonargparse.ArgumentParser:
    """build_parser() once per process: it reads the config classes' source for their
    field docs (most of the time a bad command line takes to be answered in-process), and
    a parse leaves the parser as it was."""
    return build_parser()


def _canonical(arg: str) -> str:
    """Returns a flag as the parser knows it: dashes in its name as underscores
    (--rollout.max-new-tokens is --rollout.max_new_tokens), --model as --model.path;
    values pass unchanged."""
    if not arg.startswith("--") or arg == "--":
        return arg
    flag, eq, value = arg.partition("=")
    flag = "--" + flag[2:].replace("-", "_")
    return ("--model.path" if flag == "--model" else flag) + eq + value


MAX_CONFIG_BYTES = 16 * 2**20  # far more than any config; a device or /proc file is not one


class _DuplicateKey(Exception):
    pass


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice: PyYAML keeps the
    last silently (two `learner:` blocks would drop the first's fields)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"{key!r} appears twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml_file(path: str | Path) -> dict[str, Any]:
    """Returns the mapping in a YAML config file, or raises ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as file:
            text = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES // 2**20} MiB, not a config file")
    try:
        data = yaml.load(text.decode(), Loader=_UniqueKeys) or {}  # a SafeLoader
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: {err}; name each field once") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:  # the YAML parser recurses once per level
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte at {err.start})") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of config sections, got {type(data).__name__}"
        )
    if _depth(data) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{path}: nested more than {MAX_CONFIG_DEPTH} levels deep")
    return data


# A config's deepest value is a reward's kwargs (section, list, spec, kwargs, value...);
# far deeper trees are mistakes, and would reach the recursion limit further on.
MAX_CONFIG_DEPTH = 32


def _depth(tree: Any) -> int:
    """Returns how many mappings and lists deep `tree` nests (without recursing)."""
    deepest, level = 0, [tree]
    while level:
        deepest += 1
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if deepest > MAX_CONFIG_DEPTH:
            break
    return deepest


def _checked(parse: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Returns parse(*args, **kwargs); jsonargparse's errors become one-line ConfigErrors."""
    try:
        return parse(*args, **kwargs)
    except argparse.ArgumentError as err:
        raise ConfigError(_one_line(str(err))) from None


def _one_line(message: str) -> str:
    """Returns a jsonargparse error message as one line that names the field.

    jsonargparse nests its messages (`Parser key "reward.functions":` then the item's
    `Parser key "weight":` ...); the innermost line says what is wrong."""
    name = ""
    for key in re.findall(r'Parser key "([^"]+)"', message):  # outermost first
        name = key if not name or f"{key}.".startswith(f"{name}.") else f"{name}.{key}"
    if unknown := re.match(r"unrecognized arguments: (\S+)", message):
        flag = unknown[1].split("=")[0]
        flags = ["--" + key for key in build_parser().get_defaults().keys()]  # noqa: SIM118
        return f"unknown config field '{flag}'" + did_you_mean(flag, [*flags, "--model"])
    if unknown := re.search(r"(?:Group '([^']+)' does not accept o|O)ption '([^']+)'", message):
        section = ".".join(filter(None, [name, unknown[1]]))
        dotted = ".".join(filter(None, [section, unknown[2]]))
        fields = [f"{section}.{f}" if section else f for f in _fields_under(section)]
        return f"unknown config field '{dotted}'" + did_you_mean(dotted, fields)
    given = re.search(r"(?:Got|Given) value: (.*)", message)
    expected = re.search(r"Expected a (.*?)\. Got value:", message)
    if name and given and expected:
        value = given[1]
        if choices := re.match(r"typing\.Literal\[(.*)\]$", expected[1]):
            options = ast.literal_eval(f"({choices[1]},)")
            listed = ", ".join(repr(c) if c == "" else c for c in options)
            return f"{name} must be one of {listed}; got {value!r}"
        kind = _type_word(expected[1])
        if kind == "float" and _is_non_finite(value):
            return f"{name} must be finite, got {value}"
        return f"{name}: expected {kind}, got {value!r}"
    if name and (section := re.search(r"Unable to load config '([^']*)'", message)):
        return f"{name}: expected a section of fields, got {section[1]!r}"
    if name and given and (subtypes := re.search(r"Subtypes: \[(.*)\]", message)):
        if choices := re.match(r"typing\.Literal\[(.*)\], <class 'NoneType'>$", subtypes[1]):
            options = ast.literal_eval(f"({choices[1]},)")  # an optional choice
            return f"{name} must be one of {', '.join(options)} or null; got {given[1]!r}"
        kinds = " or ".join(_type_word(t) for t in subtypes[1].split(", "))
        return f"{name}: expected {kinds}, got {given[1]!r}"
    return " ".join(message.split())


def _type_word(kind: str) -> str:
    """Returns "float" for "<class 'float'>", "null" for NoneType."""
    word = re.sub(r"<class '(?:builtins\.)?([\w.]+)'>", r"\1", kind)
    return {"NoneType": "null", "dict": "mapping"}.get(word, word)


def _is_non_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _fields_under(section: str) -> list[str]:
    """Returns the field names of a section ("" for the top level, "reward.functions" for a
    reward spec)."""
    kind: Any = Config
    for part in filter(None, section.split(".")):
        kind = field_types(kind).get(part) if dataclasses.is_dataclass(kind) else None
        if typing.get_origin(kind) is list:
            (kind,) = typing.get_args(kind)
    return [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else []
