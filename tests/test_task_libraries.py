"""Task libraries as data, scored by their own scorers: reasoning-gym's tasks as a prompt
source with a held-out split, the `reasoning_gym` and `math_verify` rewards against the
libraries' own results on known answers, and GSM8K-format JSONL through the same reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reasoning_gym
from math_verify import parse, verify

from rlray.config import Config, ConfigError, RewardSpec
from rlray.data.prompts import eval_rows, read_jsonl, train_prompts
from rlray.rewards.libraries import math_verify
from rlray.rewards.libraries import reasoning_gym as reasoning_gym_reward
from rlray.rewards.loading import check_rewards, load_reward

ARITHMETIC = {"min_terms": 2, "max_terms": 2, "max_digits": 2}
# Tasks whose scorers differ: exact strings, numbers, lists, words, counts, GSM problems.
SCORED_TASKS = {
    "basic_arithmetic": ARITHMETIC,
    "chain_sum": {},
    "leg_counting": {},
    "letter_counting": {},
    "number_sorting": {},
    "spell_backward": {},
    "word_sorting": {},
    "gsm_symbolic": {},
    "gcd": {},
    "fraction_simplification": {},
}


def task_data(task: str = "basic_arithmetic", config: dict | None = None, eval_size: int = 50):
    data = Config().data
    data.train = data.eval = f"reasoning_gym:{task}"
    data.task_config = ARITHMETIC if config is None else config
    data.eval_size = eval_size
    data.question_template = [
        {"role": "system", "content": "Answer in <answer></answer> tags."},
        {"role": "user", "content": "Q: {question}"},
    ]
    return data


def questions(rows) -> list[str]:
    return [r.columns["question"] for r in rows]


# ------------------------------------------------------------------ reasoning-gym as data


def test_held_out_questions_never_appear_in_training():
    data = task_data()
    held_out = questions(eval_rows(data))
    assert len(held_out) == len(set(held_out)) == 50
    for seed in (0, 1):
        source = train_prompts(data, seed)
        assert not set(questions(source.row(i) for i in range(2000))) & set(held_out)


def test_the_held_out_split_does_not_depend_on_the_run_seed():
    data = task_data()
    first = questions(eval_rows(data))
    assert questions(eval_rows(data)) == first
    # Training is seeded by the run: the same rows for one seed, others for the next.
    a, b = train_prompts(data, 0), train_prompts(data, 1)
    assert questions(a.row(i) for i in range(20)) == questions(
        train_prompts(data, 0).row(i) for i in range(20)
    )
    # reasoning-gym's item i of seed s is Random(s + i)'s: seeds one apart must not give
    # the same stream shifted by one.
    shifted = sum(
        a.row(i + 1).columns["question"] == b.row(i).columns["question"] for i in range(50)
    )
    assert shifted < 10


def test_rows_carry_the_entry_the_library_scores():
    data = task_data()
    row = train_prompts(data, 0).row(7)
    assert row.prompt[0] == {"role": "system", "content": "Answer in <answer></answer> tags."}
    assert row.prompt[1] == {"role": "user", "content": f"Q: {row.columns['question']}"}
    dataset = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=10, **ARITHMETIC)
    entry = {"answer": row.columns["answer"], "metadata": json.loads(row.columns["metadata"])}
    assert dataset.score_answer(row.columns["answer"], entry) == 1.0
    assert row.columns["task"] == "basic_arithmetic"
    assert json.loads(row.columns["task_config"]) == ARITHMETIC


def test_bad_task_names_and_configs_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^data: unknown reasoning-gym task 'basic_arithmetik'"):
        eval_rows(task_data("basic_arithmetik"))
    with pytest.raises(ConfigError, match=r"^data.task_config: not a config of reasoning-gym's"):
        eval_rows(task_data(config={"no_such_field": 1}))
    data = task_data()
    data.question_template = [{"role": "user", "content": "no placeholder"}]
    with pytest.raises(ConfigError, match=r"^data.question_template: no message holds"):
        eval_rows(data)
    data.question_template = [{"role": "assistant", "content": "{question}"}]
    with pytest.raises(ConfigError, match=r"^data.question_template: ends with an assistant"):
        eval_rows(data)


def test_a_task_the_held_out_split_exhausts_is_refused():
    # One-digit sums of two terms: about a hundred questions; 200 held out take them all.
    config = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"]}
    config |= {"allow_parentheses": False, "allow_negation": False}
    data = task_data(config=config, eval_size=200)
    assert len(eval_rows(data)) < 200
    source = train_prompts(data, 0)
    with pytest.raises(ConfigError, match=r"^data.eval_size: the held-out split \(\d+ questions"):
        source.longest_prompts()


# ------------------------------------------------------------------ the reasoning_gym reward


@pytest.mark.parametrize("task", SCORED_TASKS)
def test_reasoning_gym_reward_equals_the_tasks_own_score_answer(task):
    data = task_data(task, SCORED_TASKS[task], eval_size=12)
    rows = eval_rows(data)
    dataset = reasoning_gym.create_dataset(task, seed=1, size=10, **SCORED_TASKS[task])
    # Each row's own answer, the next row's (mostly wrong, sometimes partly right), an
    # answer with surrounding words, and none in tags.
    guesses = [r.columns["answer"] for r in rows]
    guesses += [rows[(i + 1) % len(rows)].columns["answer"] for i in range(len(rows))]
    completions = [f"I think <answer>{g}</answer>" for g in guesses]
    completions += [f"<answer>so {rows[0].columns['answer']}</answer>", rows[0].columns["answer"]]
    guesses += [f"so {rows[0].columns['answer']}", None]
    table = rows + rows + rows[:1] + rows[:1]
    columns = {k: [r.columns[k] for r in table] for k in table[0].columns}
    scores = reasoning_gym_reward([""] * len(table), completions, **columns)
    expected = [
        dataset.score_answer(
            guess,
            {
                "question": r.columns["question"],
                "answer": r.columns["answer"],
                "metadata": json.loads(r.columns["metadata"]),
            },
        )
        for guess, r in zip(guesses, table, strict=True)
    ]
    assert scores == expected
    assert scores[: len(rows)] == [1.0] * len(rows)


def test_reasoning_gym_reward_reads_the_librarys_own_exports():
    # A JSONL row exported from reasoning-gym: question, answer, metadata naming its task.
    entry = reasoning_gym.create_dataset("leg_counting", seed=3, size=1)[0]
    completion = [{"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]
    score = reasoning_gym_reward(
        [[{"role": "user", "content": entry["question"]}]],
        [completion],
        answer=[entry["answer"]],
        metadata=[entry["metadata"]],
    )
    assert score == [1.0]
    assert reasoning_gym_reward([""], ["<answer>1</answer>"], ["1"], [{}]) == [None]


# ------------------------------------------------------------------ math_verify


MATH_CASES = [
    # completion, reference
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("3 + 4 = 7, and 7 * 2 = 14. So 14 apples.", "14"),
    ("7 is wrong; it is \\boxed{8}", "8"),
    ("7 is wrong; it is \\boxed{8}", "7"),
    ("The total is $1,234$.", "1234"),
    ("x = 2 or so", "3"),
    ("no number here", "5"),
    ("$\\sqrt{2}$", "\\sqrt{2}"),
]


def test_math_verify_reward_equals_math_verify_on_known_answers():
    completions = [c for c, _ in MATH_CASES]
    references = [r for _, r in MATH_CASES]
    scores = math_verify([""] * len(MATH_CASES), completions, references)
    # A bare LaTeX reference is read between $ signs (math-verify reads nothing in it).
    own = [
        float(verify(parse(r, extraction_mode="first_match") or parse(f"${r}$"), parse(c)))
        for c, r in MATH_CASES
    ]
    assert scores == own
    assert scores == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert parse("\\sqrt{2}", extraction_mode="first_match") == []


def test_math_verify_reads_a_gsm8k_answer_by_its_final_number():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
    scores = math_verify(
        ["", "", ""], ["She sold 1072 clips.", "\\boxed{1072}", "24"], [solution] * 3
    )
    assert scores == [1.0, 1.0, 0.0]
    assert math_verify(["", ""], ["1", "2"], [None, "not math"]) == [None, None]


def test_gsm8k_jsonl_rows_become_chat_prompts_scored_by_math_verify(tmp_path: Path):
    path = tmp_path / "gsm8k.jsonl"
    records = [
        {"question": "Tom has 3 apples and buys 4. How many now?", "answer": "3+4=7\n#### 7"},
        {"question": "A box holds 12 eggs. How many in 3 boxes?", "answer": "12*3=36\n#### 36"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = Config().data
    data.train = data.eval = str(path)
    data.question_template = [
        {"role": "system", "content": "Put the final answer in \\boxed{}."},
        {"role": "user", "content": "{question}"},
    ]
    rows = eval_rows(data)
    assert rows[0].prompt[-1] == {"role": "user", "content": records[0]["question"]}
    assert rows[1].columns == records[1]
    assert train_prompts(data, 0).row(0).columns["answer"] in {r["answer"] for r in records}
    spec = RewardSpec(name="math_verify")
    check_rewards([spec], set(rows[0].columns))  # what the run checks before any actor
    reward = load_reward(spec)
    replies = [[{"role": "assistant", "content": text}] for text in ("\\boxed{7}", "35")]
    answers = [r.columns["answer"] for r in rows]
    assert reward.fn([r.prompt for r in rows], replies, answer=answers) == [1.0, 0.0]
    # A row with neither field is named by its line.
    path.write_text(json.dumps({"query": "?"}) + "\n")
    with pytest.raises(
        ConfigError, match=r"gsm8k.jsonl:1: missing field 'prompt' \(or 'question'\)"
    ):
        read_jsonl(str(path), "data.train", question_template=data.question_template)


def test_reasoning_gym_reward_needs_the_columns_its_rows_carry():
    rows = eval_rows(task_data(eval_size=4))
    check_rewards([RewardSpec(name="reasoning_gym")], set(rows[0].columns))
    with pytest.raises(
        ConfigError, match=r"reward.functions\[0\].name \(reasoning_gym\).*metadata"
    ):
        check_rewards([RewardSpec(name="reasoning_gym")], {"answer"})
