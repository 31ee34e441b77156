"""RLlib's LearnerGroup (Ray 2.60) against a process group set up directly (issue 14).

    python benchmarks/rllib_learner_group.py                       # creates RLlib's venv, runs all
    python benchmarks/rllib_learner_group.py --venv /tmp/rllib-venv  # an existing venv

RLlib runs in a virtualenv of its own (ray[rllib]==RLLIB_VERSION and this torch's version,
created on first use under rlray's cache folder); it is never a dependency of rlray.

Every run makes one update of a tiny seeded language model (embedding, residual MLP
blocks, output head) with a policy-gradient loss on one fixed batch of 8 token rows, and
compares the parameters afterwards with the same update made in one plain process on the
whole batch (max abs difference):

(a) RLlib, no FSDP: LearnerGroup with 0 (local), 1 and 2 CPU learners; RLlib shards the
    batch over the learners and wraps the module in DDP when there are 2.
(b) RLlib hosting FSDP2 (`fully_shard`) in place of its DDP, 2 learners: the working
    setup (the RLModule's inner network sharded before RLlib builds the optimizer, RLlib's
    DDP wrapping off, an update step without DDP's `no_sync`), with SGD and with AdamW and
    RLlib's global-norm clipping; the attempts that fail, each differing from it in one
    place (sharding in RLlib's DDP hook, sharding the RLModule itself, RLlib's own update
    step); and RLlib's checkpoint state (`LearnerGroup.get_state`) of sharded learners.
(c) the same FSDP2 update with a process group set up directly: one Ray actor per rank,
    rank 0 publishes its address and a free port, every actor joins (gloo). The lines of
    code each approach needs are counted from this file: the bodies of `rllib_glue` and
    `direct_glue` (code, not comments, docstrings or blank lines).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import inspect
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

RLLIB_VERSION = "2.60.0"
REPO = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN, BLOCKS, ROWS, LENGTH = 32, 16, 2, 8, 12
SGD_LR, ADAMW_LR, CLIP = 0.5, 1e-2, 0.05  # CLIP is below the gradient norm: clipping acts
STATE_TIMEOUT_S = 20


# --- RLlib's virtualenv -------------------------------------------------------------


def rllib_python(venv: Path | None) -> Path:
    """Returns the python of RLlib's virtualenv, creating it on first use: ray[rllib] at
    RLLIB_VERSION and the torch version rlray runs (pip takes a local torch wheel)."""
    torch_version = importlib.metadata.version("torch").split("+")[0]
    if venv is None:
        sys.path.insert(0, str(REPO))
        from rlray.data.cache import cache_dir

        venv = cache_dir() / "venvs" / f"rllib-{RLLIB_VERSION}-torch-{torch_version}"
    python = venv / "bin" / "python"
    check = [
        str(python),
        "-c",
        f"import ray.rllib, ray; assert ray.__version__ == '{RLLIB_VERSION}'",
    ]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"creating {venv} (ray[rllib] {RLLIB_VERSION}, torch {torch_version})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for package in (f"torch=={torch_version}", f"ray[rllib]=={RLLIB_VERSION}"):
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", package],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"installing {package} failed:\n{done.stderr[-3000:]}")
    return python


# --- the model, the batch, the loss: shared by every run ----------------------------


class Block(nn.Module):
    """A residual MLP block: (B, T, H) -> (B, T, H)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyLM(nn.Module):
    """Returns next-token logits (B, T, V) for tokens (B, T); the same weights wherever built."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fixed_batch() -> dict[str, np.ndarray]:
    """Returns the batch every run trains on: tokens (ROWS, LENGTH + 1), advantages (ROWS,)."""
    rng = np.random.default_rng(0)
    return {
        "tokens": rng.integers(0, VOCAB, size=(ROWS, LENGTH + 1), dtype=np.int64),
        "advantages": rng.standard_normal(ROWS).astype(np.float32),
    }


def pg_loss(logits: torch.Tensor, tokens: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Returns the policy-gradient loss -mean(advantage * logprob) over every token, from
    the logits (B, T, V) of tokens (B, T + 1) without their last."""
    logp = logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T)
    return -(advantages[:, None] * logp).mean()


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """Returns SGD (its step shows any gradient difference) or AdamW (what rlray uses)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=ADAMW_LR)


def full_parameters(model: nn.Module) -> dict[str, np.ndarray]:
    """Returns every parameter as a whole array; with FSDP2 every rank must call it."""
    out = {}
    for name, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = p.detach().cpu().numpy().copy()
    return out


def reference_update(optimizer: str, clip: float | None) -> dict[str, np.ndarray]:
    """Returns the parameters after one update in one process on the whole batch."""
    model = TinyLM()
    opt = make_optimizer(optimizer, model.parameters())
    batch = {k: torch.from_numpy(v) for k, v in fixed_batch().items()}
    pg_loss(model(batch["tokens"][:, :-1]), batch["tokens"], batch["advantages"]).backward()
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        print(f"  reference: gradient norm {norm:.3f}, clipped to {clip}", flush=True)
    opt.step()
    return full_parameters(model)


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Returns the largest absolute difference over all parameters of two models."""
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a)} vs {sorted(b)}")
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# --- RLlib --------------------------------------------------------------------------


def shard_tiny_lm(lm: nn.Module) -> None:
    """Shards TinyLM's parameters over the process group with FSDP2: each block, then the
    rest (embedding, head) at the root."""
    from torch.distributed.fsdp import fully_shard

    for block in lm.blocks:
        fully_shard(block)
    fully_shard(lm)


def rllib_glue(learners: int, optimizer: str, clip: float | None, fsdp: bool, variant=None):
    """Returns a LearnerGroup of `learners` learners training TinyLM with pg_loss, the
    module in RLlib's DDP (fsdp=False) or sharded with FSDP2; `variant` may replace the
    learner class with a subclass of it (the attempts that fail)."""
    import gymnasium as gym
    from ray.rllib.algorithms.algorithm_config import AlgorithmConfig
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

    class TinyLMModule(TorchRLModule):
        def setup(self):
            self.lm = TinyLM()

        def _forward_train(self, batch, **kwargs):
            return {"logits": self.lm(batch["tokens"][:, :-1])}

    class TinyLMLearner(TorchLearner):
        def configure_optimizers_for_module(self, module_id, config=None):
            params = self.get_parameters(self._module[module_id])
            opt = make_optimizer(config.learner_config_dict["optimizer"], params)
            self.register_optimizer(
                module_id=module_id,
                optimizer=opt,
                params=params,
                lr_or_lr_schedule=opt.defaults["lr"],
            )

        def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
            return pg_loss(fwd_out["logits"], batch["tokens"], batch["advantages"])

        def _make_module(self):
            module = super()._make_module()
            if fsdp:  # here, before RLlib builds the optimizer from the parameters
                shard_tiny_lm(module[DEFAULT_MODULE_ID].lm)
            return module

        def _make_modules_ddp_if_necessary(self):
            if not fsdp:
                super()._make_modules_ddp_if_necessary()

        def _uncompiled_update(self, batch, **kwargs):
            if not fsdp:
                return super()._uncompiled_update(batch, **kwargs)
            # RLlib's own enters DDP's `no_sync` around the optimizer step; FSDP2 has none.
            fwd_out = self.module.forward_train(batch)
            losses = self.compute_losses(fwd_out=fwd_out, batch=batch)
            self.apply_gradients(self.postprocess_gradients(self.compute_gradients(losses)))
            return fwd_out, losses, {}

    config = (
        AlgorithmConfig()
        .framework("torch")
        .training(grad_clip=clip, grad_clip_by="global_norm")
        .learners(
            learner_class=TinyLMLearner if variant is None else variant(TinyLMLearner),
            num_learners=learners,
            num_cpus_per_learner=1,
            learner_config_dict={"optimizer": optimizer},
        )
    )
    spec = RLModuleSpec(
        module_class=TinyLMModule,
        observation_space=gym.spaces.Box(0, VOCAB - 1, (LENGTH + 1,), np.int64),
        action_space=gym.spaces.Discrete(VOCAB),
    )
    return config.build_learner_group(rl_module_spec=spec)


# The attempts at FSDP2 in RLlib that fail, each a subclass of the working learner.


def shard_in_ddp_hook(learner_class):
    """Shards where RLlib wraps in DDP (after it has built the optimizer)."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    class ShardInDDPHook(learner_class):
        def _make_module(self):
            return TorchLearner._make_module(self)

        def _make_modules_ddp_if_necessary(self):
            shard_tiny_lm(self._module[DEFAULT_MODULE_ID].lm)

    return ShardInDDPHook


def shard_rl_module(learner_class):
    """Shards the RLModule itself (its blocks, then the RLModule as the root)."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner
    from torch.distributed.fsdp import fully_shard

    class ShardRLModule(learner_class):
        def _make_module(self):
            module = TorchLearner._make_module(self)
            for block in module[DEFAULT_MODULE_ID].lm.blocks:
                fully_shard(block)
            fully_shard(module[DEFAULT_MODULE_ID])
            return module

    return ShardRLModule


def rllib_update_as_is(learner_class):
    """Keeps RLlib's own update step (it enters DDP's `no_sync`)."""
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    class UpdateAsIs(learner_class):
        def _uncompiled_update(self, batch, **kwargs):
            return TorchLearner._uncompiled_update(self, batch, **kwargs)

    return UpdateAsIs


def learner_parameters(learner) -> dict:
    """Returns the learner's whole parameters, the local shapes of its embedding and of
    its optimizer's state, and whether its optimizer updates the module's parameters;
    every learner of a sharded group must call it."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    lm = learner.module[DEFAULT_MODULE_ID].unwrapped().lm
    optimizer = learner.get_optimizer()
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    facts = {
        "embed": local_shape(lm.embed.weight),
        "optimizer steps the module's parameters": all(id(p) in held for p in lm.parameters()),
    }
    moments = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    if moments:
        facts["optimizer state"] = f"{type(moments[0]).__name__} {local_shape(moments[0])}"
    return {"params": full_parameters(lm), "facts": facts}


def local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """Returns the shape of this process's part of a tensor (a DTensor's shard)."""
    return tuple(tensor.to_local().shape if hasattr(tensor, "to_local") else tensor.shape)


def run_rllib(
    label: str,
    learners: int,
    optimizer: str,
    clip: float | None,
    reference,
    *,
    fsdp: bool = False,
    variant=None,
) -> None:
    """Runs one RLlib update and prints its difference from the reference or its error;
    with FSDP2 also what RLlib's checkpoint state does."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

    started = time.perf_counter()
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(fixed_batch())}, env_steps=ROWS)
    group = None
    try:
        group = rllib_glue(learners, optimizer, clip, fsdp, variant)
        group.update(batch=batch)
        results = [r.get() for r in group.foreach_learner(learner_parameters)]
    except Exception as error:
        print(
            f"  {label}: FAILED after {time.perf_counter() - started:.0f} s",
            f"\n    {last_lines(error)}",
            flush=True,
        )
        if group is not None:
            group.shutdown()
        return
    diff = max(max_diff(r["params"], reference) for r in results)
    seconds = time.perf_counter() - started
    print(f"  {label}: max |param - reference| = {diff:.3g} ({seconds:.0f} s)", flush=True)
    if fsdp:
        for rank, result in enumerate(results):
            print(f"    learner {rank}: {result['facts']}", flush=True)
        print_state_attempts(group)
        for worker in group._workers:  # learner 0 may hang in a collective: no graceful end
            ray.kill(worker)
    else:
        group.shutdown()


def print_state_attempts(group) -> None:
    """Prints what RLlib's checkpoint state (LearnerGroup.get_state) does with sharded
    parameters, and what gathering them on learner 0 alone does, as get_state asks."""
    try:
        group.get_state()
        print("    LearnerGroup.get_state(): ok", flush=True)
    except Exception as error:
        print(f"    LearnerGroup.get_state(): FAILED\n      {last_lines(error, 1)}", flush=True)
    results = group.foreach_learner(
        learner_parameters,
        remote_actor_ids=[0],
        healthy_only=False,
        timeout_seconds=STATE_TIMEOUT_S,
    )
    answered = len(list(results))
    print(
        f"    whole parameters gathered on learner 0 alone (as get_state asks):"
        f" {answered} answers in {STATE_TIMEOUT_S} s",
        flush=True,
    )


def last_lines(error: Exception, n: int = 6) -> str:
    """Returns the last n non-blank lines of an error's message (a remote one's traceback)."""
    text = f"{type(error).__name__}: {error}"
    lines = [line for line in text.splitlines() if line.strip() and "^^^" not in line]
    return "\n    ".join(lines[-n:])


# --- a process group set up directly ------------------------------------------------


def direct_glue(ranks: int, optimizer: str, clip: float | None) -> list[dict[str, np.ndarray]]:
    """Returns every rank's parameters after one FSDP2 update of TinyLM on its share of
    the batch, the process group set up by the actors themselves."""
    import torch.distributed as dist

    @ray.remote(num_cpus=1)
    class Rank:
        def address(self) -> tuple[str, int]:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                return ray.util.get_node_ip_address(), s.getsockname()[1]

        def update(self, rank: int, address: str, port: int, batch: dict) -> dict:
            dist.init_process_group(
                "gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=ranks
            )
            model = TinyLM()
            shard_tiny_lm(model)
            opt = make_optimizer(optimizer, model.parameters())
            rows = slice(rank * ROWS // ranks, (rank + 1) * ROWS // ranks)
            tokens, advantages = (
                torch.from_numpy(batch[k][rows]) for k in ("tokens", "advantages")
            )
            # FSDP2 averages the gradients over the ranks
            pg_loss(model(tokens[:, :-1]), tokens, advantages).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            params = full_parameters(model)
            dist.destroy_process_group()
            return params

    actors = [Rank.remote() for _ in range(ranks)]
    address, port = ray.get(actors[0].address.remote())
    batch = fixed_batch()
    return ray.get([a.update.remote(r, address, port, batch) for r, a in enumerate(actors)])


def run_direct(label: str, optimizer: str, clip: float | None, reference) -> dict:
    """Runs the direct 2-rank FSDP2 update and prints its difference from the reference."""
    started = time.perf_counter()
    params = direct_glue(2, optimizer, clip)
    diff = max(max_diff(p, reference) for p in params)
    print(
        f"  {label}: max |param - reference| = {diff:.3g} ({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return {"label": label, "max_abs_diff": diff}


def code_lines(function) -> int:
    """Returns the lines of code in a function's body: no docstring, comments or blanks."""
    source = inspect.getsource(function)
    body = ast.parse(source).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    first, last = body[0].lineno, body[-1].end_lineno
    lines = source.splitlines()[first - 1 : last]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


# --- the measurement ----------------------------------------------------------------


def measure() -> None:
    """Runs (a), (b) and (c) in this interpreter (RLlib's venv) and prints the results."""
    # RLlib logs each failing learner call's traceback; the errors are printed below.
    logging.getLogger("ray.rllib").setLevel(logging.CRITICAL)
    # More CPUs than cores: a learner group that fails to build may leave actors behind.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    print(
        f"ray {ray.__version__}, torch {torch.__version__}, {ROWS} rows x {LENGTH} tokens",
        flush=True,
    )
    sgd = reference_update("sgd", None)
    moved = max_diff(sgd, full_parameters(TinyLM()))
    print(f"  reference: the SGD update moves parameters by up to {moved:.3g}", flush=True)
    adamw_clip = reference_update("adamw", CLIP)

    print("(a) RLlib LearnerGroup, its own DDP, SGD: one update vs one process", flush=True)
    for learners in (0, 1, 2):
        run_rllib(f"num_learners={learners}", learners, "sgd", None, sgd)
    run_rllib("num_learners=2, AdamW + global-norm clip", 2, "adamw", CLIP, adamw_clip)

    print("(b) RLlib LearnerGroup hosting FSDP2 (fully_shard), 2 learners", flush=True)
    run_rllib("working setup, SGD", 2, "sgd", None, sgd, fsdp=True)
    run_rllib("working setup, AdamW + global-norm clip", 2, "adamw", CLIP, adamw_clip, fsdp=True)
    for variant in (shard_in_ddp_hook, shard_rl_module, rllib_update_as_is):
        label = variant.__doc__.splitlines()[0].rstrip(".")
        run_rllib(label, 2, "sgd", None, sgd, fsdp=True, variant=variant)

    print("(c) process group set up directly, FSDP2, 2 ranks", flush=True)
    run_direct("direct, SGD", "sgd", None, sgd)
    run_direct("direct, AdamW + clip", "adamw", CLIP, adamw_clip)
    print(f"  lines of code: RLlib glue {code_lines(rllib_glue)}, direct {code_lines(direct_glue)}")
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="RLlib's virtualenv (created if missing)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        measure()
        return
    python = rllib_python(args.venv)
    subprocess.run([str(python), __file__, "--inside"], check=True, cwd=REPO)


if __name__ == "__main__":
    main()
