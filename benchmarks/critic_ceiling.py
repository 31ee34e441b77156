"""How much of the default task's return can a critic explain? Why PPO's critic stays
near explained variance 0 in the default run.

    python benchmarks/critic_ceiling.py                    # collects 1024 prompts x 4 first
    python benchmarks/critic_ceiling.py --store runs/x/episodes --lrs 1e-4 1e-3

1. Episodes of the warm-started embedded model on the default task (jobs/collect.py,
   the default job's sampling), or an existing episode store.
2. The ceiling of a critic that reads only the prompt: the share of reward variance that
   is between prompts (the variance of each prompt's success probability, estimated
   without bias from its samples) - what a perfect value at the first completion token
   explains.
3. A critic (the model's trunk and a value head, as rlray's PPO builds it) trained
   offline on the Monte Carlo returns of 3/4 of the prompts, for many passes, and its
   explained variance on the other 1/4: what it learns that carries to new prompts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlray.algorithms import rl_math as rm  # noqa: E402
from rlray.core.episode import Episode, from_table  # noqa: E402
from rlray.data.models import resolve_model_path  # noqa: E402
from rlray.episodes.reader import read  # noqa: E402
from rlray.learner.batches import Outputs, TokenBatch, collate  # noqa: E402
from rlray.learner.engine import Engine  # noqa: E402
from rlray.learner.engine_settings import EngineSettings  # noqa: E402


def collect(out: Path, prompts: int) -> Path:
    """Runs jobs/collect.py into `out` unless it ran already; returns the store's path."""
    if not (out / "summary.json").is_file():
        command = [sys.executable, str(REPO / "jobs" / "collect.py"), "--prompts", str(prompts)]
        subprocess.run([*command, "--run-dir", str(out)], cwd=REPO, check=True)
    return out / "episodes"


def prompt_share_of_variance(episodes: list[Episode]) -> tuple[float, float]:
    """Returns (reward variance, share of it between prompts)."""
    groups: dict[int, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.prompt_index, []).append(float(e.reward))
    rewards = [r for g in groups.values() for r in g]
    total = statistics.pvariance(rewards)
    samples = statistics.mean(len(g) for g in groups.values())
    means = [statistics.mean(g) for g in groups.values()]
    within = statistics.mean(statistics.variance(g) for g in groups.values())
    # Var(group mean) = Var(p) + E[p (1 - p)] / n: take the sampling part out.
    return total, (statistics.pvariance(means) - within / samples) / total


def tensors(episodes: list[Episode]) -> tuple[TokenBatch, torch.Tensor]:
    """Returns the episodes' batch and their (B, T) Monte Carlo returns (the reward)."""
    batch = collate(
        [e.prompt_token_ids for e in episodes], [e.completion_token_ids for e in episodes], 0
    )
    reward = torch.tensor([float(e.reward) for e in episodes])
    return batch, reward[:, None] * batch.mask


def explained(engine: Engine, batch: TokenBatch, returns: torch.Tensor) -> list[float]:
    """Returns explained variance over all tokens, then at completion positions 0, 1, 2."""
    values = engine.score(batch).values
    shares = [rm.explained_variance(values, returns, batch.mask)]
    for position in range(3):
        at = torch.zeros_like(batch.mask)
        at[:, position] = batch.mask[:, position]
        shares.append(rm.explained_variance(values, returns, at))
    return shares


def train_critic(model: str, lr: float, passes: int, episodes: list[Episode]) -> None:
    """Trains a fresh critic on 3/4 of the prompts; prints held-out explained variance."""
    prompts = sorted({e.prompt_index for e in episodes})
    cut = prompts[len(prompts) * 3 // 4]
    train, held = (
        tensors([e for e in episodes if e.prompt_index < cut]),
        tensors([e for e in episodes if e.prompt_index >= cut]),
    )
    engine = Engine(
        model, EngineSettings(with_critic=True, lr=0.0, critic_lr=lr, micro_batch_size=256)
    )
    batch, returns = train

    def value_loss(outputs: Outputs, rows: torch.Tensor, totals) -> tuple[torch.Tensor, dict]:
        error = (outputs.values - returns[rows]) ** 2
        return 0.5 * rm.masked_mean(error, batch.mask[rows], totals.tokens), {}

    updates_per_pass = max(1, round(batch.size / 128))
    for done in range(1, passes + 1):
        engine.train(batch, batch.mask, value_loss, epochs=1, minibatch_size=128)
        if done % 5 == 0 or done == passes:
            held_out = ", ".join(f"{x:+.3f}" for x in explained(engine, *held))
            seen = explained(engine, *train)[0]
            print(
                f"  critic lr {lr:g}: {done * updates_per_pass:4d} updates  "
                f"held-out EV (all, pos 0, 1, 2) {held_out}   training-set EV {seen:+.3f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", help="an episode store; default: collect one")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-critic-collect")
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 1e-3])
    parser.add_argument("--passes", type=int, default=30)
    args = parser.parse_args()
    store = args.store or collect(args.out, args.prompts)
    episodes = [e for e in from_table(read(str(store))) if e.reward is not None]
    variance, between = prompt_share_of_variance(episodes)
    mean = statistics.mean(e.reward for e in episodes)
    print(f"{len(episodes)} episodes, reward mean {mean:.3f}")
    print(f"reward variance {variance:.4f}; between prompts: {between:.3f} of it")
    print(f"ceiling of a critic that reads only the prompt: explained variance {between:.3f}")
    for lr in args.lrs:
        train_critic(resolve_model_path("builtin:tiny-arithmetic"), lr, args.passes, episodes)


if __name__ == "__main__":
    main()
