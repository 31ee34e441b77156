"""The built-in preference task run as users run it: DPO on the built-in pairs, a reward
model fit to the same pairs, and the default PPO job trained with that reward model as
its only reward beside the same job trained with exact match, in one run.

python benchmarks/preference_task.py                      # the jobs' defaults
python benchmarks/preference_task.py --rm-steps 1000 --ppo-steps 50

Prints held-out greedy exact match before and after (DPO, both PPO runs), the reward
model's held-out pairwise accuracy, its accuracy on pairs of the base policy's own
mistakes (each held-out prompt's correct sum over a wrong answer the policy sampled),
and each job's wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rm-steps", type=int, default=None, help="reward model steps")
    parser.add_argument("--ppo-steps", type=int, default=None, help="steps of each PPO run")
    parser.add_argument("--eval-pairs", type=int, default=200, help="held-out pairs")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="preference-"))
    held = ["--preference.eval_pairs", str(args.eval_pairs)]

    dpo, dpo_wall = run("dpo.py", [*held, "--run-dir", str(root / "dpo")])
    rm_steps = ["--preference.reward_model_steps", str(args.rm_steps)] if args.rm_steps else []
    rm, rm_wall = run("reward_model.py", [*held, *rm_steps, "--run-dir", str(root / "rm")])
    ppo_steps = ["--learner.steps", str(args.ppo_steps)] if args.ppo_steps else []
    learned_reward = f"[{{name: classifier_reward, kwargs: {{model_path: {rm['reward_model']}}}}}]"
    rewards = {"exact_match": "[{name: exact_match}]", "reward model": learned_reward}
    ppo = {
        name: run(
            "ppo.py",
            [
                *ppo_steps,
                "--reward.functions",
                functions,
                "--run-dir",
                str(root / name.replace(" ", "-")),
            ],
        )
        for name, functions in rewards.items()
    }

    before, after = dpo["initial_eval"], dpo["final_eval"]
    print(f"DPO, {dpo['steps']} steps of {dpo['pairs_per_step']} pairs ({dpo_wall:.0f} s):")
    print(f"  held-out exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}")
    print(f"  held-out implicit-reward accuracy {after['pairs/accuracy']:.3f}")
    print(f"reward model, {rm['steps']} steps of {rm['pairs_per_step']} pairs ({rm_wall:.0f} s):")
    print(
        f"  held-out pairwise accuracy {rm['initial_eval']['accuracy']:.3f} -> "
        f"{rm['final_eval']['accuracy']:.3f} ({rm['held_out_pairs']} pairs)"
    )
    own, count = accuracy_on_own_mistakes(rm["reward_model"], args.eval_pairs)
    print(f"  on the base policy's own mistakes: {own:.3f} ({count} pairs)")
    for name, (summary, wall) in ppo.items():
        first, last = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
        print(
            f"PPO with {name} as the only reward, {summary['steps']} steps ({wall:.0f} s): "
            f"held-out exact match {first:.3f} -> {last:.3f}"
        )


def run(job: str, args: list[str]) -> tuple[dict, float]:
    """Runs jobs/JOB with ARGS; returns its summary.json and its wall time."""
    run_dir = Path(args[args.index("--run-dir") + 1])
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "jobs" / job), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        sys.exit(f"jobs/{job} failed:\n{result.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text()), time.monotonic() - started


def accuracy_on_own_mistakes(model_path: str, count: int) -> tuple[float, int]:
    """Returns the reward model's pairwise accuracy on the held-out prompts' correct sums
    over a wrong answer the base policy sampled (temperature 1, seeded; prompts where
    none of 8 samples is wrong are left out), and the number of pairs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlray.config import Config, DataConfig
    from rlray.data.models import resolve_model_path
    from rlray.data.prompts import eval_rows
    from rlray.rewards.model_based import ClassifierReward

    torch.manual_seed(0)
    policy_path = resolve_model_path(Config().model.path)
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_path).eval()
    rows = eval_rows(DataConfig())[:count]
    inputs = tokenizer([r.prompt for r in rows], return_tensors="pt", padding=True)
    samples = policy.generate(
        **inputs,
        do_sample=True,
        temperature=1.0,
        max_new_tokens=6,
        num_return_sequences=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(
        samples[:, inputs.input_ids.shape[1] :], skip_special_tokens=True
    )
    prompts, chosen, rejected = [], [], []
    for i, row in enumerate(rows):
        answer = row.columns["answer"]
        wrong = [t.strip() for t in texts[8 * i : 8 * i + 8] if t.strip() not in ("", answer)]
        if wrong:
            prompts.append(row.prompt)
            chosen.append(answer)
            rejected.append(wrong[0])
    score = ClassifierReward(model_path)
    right = [a > b for a, b in zip(score(prompts, chosen), score(prompts, rejected), strict=True)]
    return sum(right) / len(right), len(right)


if __name__ == "__main__":
    main()
