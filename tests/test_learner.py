"""The Learner in-process on the embedded tiny model: every estimator and policy loss
moves probability toward rewarded completions, the critic learns, a loss-mode KL pulls
toward the reference, micro-batches change nothing, bfloat16 keeps float32 masters,
groups arrive whole, and a checkpoint restores everything a run needs."""

from __future__ import annotations

import typing

import pytest
import torch

from rlray.algorithms.rl_math import NonFiniteError
from rlray.config import Config
from rlray.config.schema import Advantage, LossAggregation, PolicyLoss
from rlray.core.checkpoints import checkpoint_problem, latest_checkpoint
from rlray.core.episode import Episode, EpisodeError
from rlray.core.idle_cores import CoreLender, IdleCores
from rlray.core.parity import parity_gap
from rlray.data.models import resolve_model_path
from rlray.learner.batches import Outputs, collate, shared_prompts
from rlray.learner.distributed import decoder_layers
from rlray.learner.rl import Learner

PROMPT = "12+34="


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path(Config().model.path)


def make_learner(
    model_path: str,
    device: str = "cpu",
    checkpoint: str | None = None,
    temperature: float = 1.0,
    lent_cores: typing.Callable[[], int] | None = None,
    **changes,
) -> Learner:
    """Returns a learner of 4-episode steps that samples at `temperature`; `changes` set
    config fields by dotted name."""
    config = Config()
    # Adam moves every weight by about lr on its first steps; a tiny model needs a small lr.
    config.learner.lr = 1e-5
    config.learner.episodes_per_step = 4
    config.learner.minibatch_size = config.learner.micro_batch_size = 4
    config.learner.micro_batch_tokens = 0  # micro-batches of episodes; budget tests set one
    config.learner.epochs = 2  # two updates a step (the default makes one)
    config.algorithm.kl_coef = 0.0  # no reference unless a test asks for one
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        setattr(getattr(config, section), name, value)
    return Learner(
        model_path,
        config.model,
        config.algorithm,
        config.learner,
        max_new_tokens=config.rollout.max_new_tokens,
        samples_per_prompt=4,
        temperature=temperature,
        seed=0,
        device=device,
        checkpoint=checkpoint,
        lent_cores=lent_cores,
    )


def plain_logprobs(model: torch.nn.Module, episodes: list[Episode]) -> list[list[float]]:
    """Returns the model's logprob of each completion token (temperature 1) from a plain
    transformers forward pass, one unpadded episode at a time: none of the learner's
    collation, position ids, logits slicing or gathering."""
    device = next(model.parameters()).device
    result = []
    for e in episodes:
        ids = torch.tensor([e.prompt_token_ids + e.completion_token_ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].double()  # (L, V)
        start = len(e.prompt_token_ids) - 1  # the logits that predict completion token 0
        logp = torch.log_softmax(logits[start:-1], dim=-1)  # (T, V)
        targets = torch.tensor(e.completion_token_ids, device=device)
        result.append(logp.gather(1, targets[:, None])[:, 0].tolist())
    return result


def plain_logprob_gap(model: torch.nn.Module, episodes: list[Episode]) -> float:
    """Returns max |rollout logprob - plain_logprobs| over every sampled token."""
    return max(
        abs(a - b)
        for e, plain in zip(episodes, plain_logprobs(model, episodes), strict=True)
        for a, b in zip(e.rollout_logprobs, plain, strict=True)
    )


def episodes_for(
    learner: Learner, completions: dict[str, float], prompt: str = PROMPT, prompt_index: int = 0
) -> list[Episode]:
    """Episodes of one prompt with the given completions and rewards. Their rollout
    logprobs are what vLLM's would be after an exact weight sync: the logprobs of the
    learner's current weights, computed independently of the learner (plain_logprobs)."""
    tok = learner.tokenizer
    prompt_ids = tok(prompt).input_ids
    ids = {text: [*tok(text).input_ids, tok.eos_token_id] for text in completions}
    episodes = [
        Episode(
            run_id="t",
            episode_id=f"t-{prompt_index}-{i}",
            prompt_index=prompt_index,
            sample_index=i,
            prompt=prompt,
            completion=text,
            prompt_token_ids=prompt_ids,
            completion_token_ids=ids[text],
            rollout_logprobs=[0.0] * len(ids[text]),
            finish_reason="stop",
            policy_version=learner.version,
            rollout_worker="test",
            reward=reward,
        )
        for i, (text, reward) in enumerate(completions.items())
    ]
    for episode, logprobs in zip(
        episodes, plain_logprobs(learner.engine.policy, episodes), strict=True
    ):
        episode.rollout_logprobs = logprobs
    return episodes


def sequence_logprob(learner: Learner, episodes: list[Episode]) -> list[float]:
    return [sum(lp) for lp in learner.logprobs(episodes)]


REWARDS = {"46": 1.0, "57": 0.0, "35": 0.0, "68": 0.0}  # no shared first digit


def log_odds_of_rewarded(logprobs: list[float]) -> float:
    """Returns log p(rewarded) - log sum p(unrewarded) over the four completions."""
    return logprobs[0] - torch.tensor(logprobs[1:]).logsumexp(0).item()


def assert_moves_toward_rewarded(
    learner: Learner, steps: int = 3, gain: float = 0.3, parity: float = 1e-5
) -> None:
    """Trains `steps` steps on REWARDS; each step's parity error (the learner's logprobs
    against plain_logprobs of the same weights) must be within `parity`."""
    before = sequence_logprob(learner, episodes_for(learner, REWARDS))
    for step in range(steps):
        metrics = learner.train_step(episodes_for(learner, REWARDS))
        assert metrics.logprob_parity_error is not None
        assert metrics.logprob_parity_error < parity, metrics.logprob_parity_error
        if step == 0:  # the first update follows the gradient: the rewarded one rises
            first = sequence_logprob(learner, episodes_for(learner, REWARDS))
            assert first[0] > before[0], (before, first)
    after = sequence_logprob(learner, episodes_for(learner, REWARDS))
    # Over the steps the rewarded completion gains on the unrewarded ones taken together.
    # Its own logprob need not keep rising: Adam's later steps can move mass to
    # completions outside these four (measured on an AVX-512 machine's tiny model: +0.024
    # after one step, -0.021 after three, while its log-odds gained 0.35).
    assert log_odds_of_rewarded(after) > log_odds_of_rewarded(before) + gain, (before, after)
    assert learner.version == steps


@pytest.mark.parametrize("advantage", typing.get_args(Advantage))
def test_every_estimator_moves_probability_toward_rewarded_completions(
    model_path, device, advantage
):
    # reinforce_pp whitens over the batch: with one rewarded episode of four its
    # advantages keep the same sign pattern as the group estimators'.
    learner = make_learner(model_path, device, algorithm__advantage=advantage)
    assert (learner.engine.critic is not None) == (advantage == "gae")
    assert_moves_toward_rewarded(learner)


@pytest.mark.parametrize("loss", typing.get_args(PolicyLoss))
def test_every_policy_loss_moves_probability_toward_rewarded_completions(model_path, device, loss):
    learner = make_learner(
        model_path, device, algorithm__advantage="grpo", algorithm__policy_loss=loss
    )
    # GSPO clips its sequence ratio at 1 +- 4e-4: after the first mini-batch it moves
    # little more within a step, so it moves less in three steps.
    assert_moves_toward_rewarded(learner, gain=0.2 if loss == "gspo" else 0.3)


def test_no_critic_and_no_reference_unless_the_algorithm_needs_them(model_path, device):
    learner = make_learner(model_path, device, algorithm__advantage="rloo", algorithm__kl_coef=0.0)
    assert learner.engine.critic is None and learner.engine.reference is None
    metrics = learner.train_step(episodes_for(learner, REWARDS))
    assert metrics.value_loss is None and metrics.explained_variance is None
    assert metrics.kl is None


def test_critic_learns_a_reward_that_depends_on_the_prompt(model_path, device):
    # Prompt A's completions always earn 1, prompt B's never: a baseline that only knows
    # the mean explains none of it; a critic that reads the prompt explains it all.
    learner = make_learner(
        model_path,
        device,
        algorithm__advantage="gae",
        learner__episodes_per_step=8,
        learner__minibatch_size=8,
        learner__micro_batch_size=8,
    )
    completions = ["46", "57", "35", "68"]
    history = []
    for _ in range(30):
        batch = episodes_for(learner, dict.fromkeys(completions, 1.0), "12+34=", 0)
        batch += episodes_for(learner, dict.fromkeys(completions, 0.0), "21+43=", 1)
        history.append(learner.train_step(batch).explained_variance)
    assert abs(history[0]) < 0.05  # the value head starts at 0
    assert max(history[-5:]) > 0.8, history


def test_loss_mode_kl_pulls_the_policy_toward_the_reference(model_path, device):
    # Every completion gets the same reward: advantages are 0 and only the KL term moves
    # the policy. Push the policy away from the reference first.
    learner = make_learner(
        model_path,
        device,
        algorithm__advantage="grpo",
        algorithm__kl_mode="loss",
        algorithm__kl_estimator="k3",
        algorithm__kl_coef=1.0,
        # At 1e-3 Adam's first steps overshoot (KL 0.16 -> 21), and only k3's unbounded
        # gradient at far tokens, now clamped as verl's, pulled the policy back.
        learner__lr=1e-4,
    )
    # Drawn on the host, so that every --device pushes the same way (CUDA's generator
    # draws other numbers, and a push 16x farther in KL than the CPU's did not come back).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in learner.engine.policy.parameters():
            push = torch.randn(parameter.shape, generator=generator) * 0.02
            parameter.add_(push.to(parameter.device))
    same = dict.fromkeys(REWARDS, 1.0)
    first = learner.train_step(episodes_for(learner, same))
    for _ in range(8):
        last = learner.train_step(episodes_for(learner, same))
    assert first.advantage_abs_mean == 0.0
    assert first.kl > 0.01
    assert last.kl < 0.5 * first.kl, (first.kl, last.kl)


def test_masking_truncated_completions_keeps_dr_grpos_normaliser(model_path, device):
    # Dr. GRPO divides every token loss by G * max_new_tokens, G the samples of the
    # mini-batch. Two of four samples are truncated, with zero advantage (reward 0.5, the
    # group's mean): masking them out of the loss must leave the loss as it was, not
    # double it by counting G = 2.
    rewards = {"46": 1.0, "4": 0.0, "35": 0.5, "68": 0.5}  # unequal lengths: a loss != 0
    losses = []
    for mask_truncated in (False, True):
        learner = make_learner(
            model_path,
            device,
            algorithm__advantage="dr_grpo",
            algorithm__loss_aggregation="seq_mean_token_sum_norm",
            algorithm__mask_truncated=mask_truncated,
            learner__epochs=1,
        )
        episodes = episodes_for(learner, rewards)
        for episode in episodes[2:]:
            episode.finish_reason = "length"
        metrics = learner.train_step(episodes)
        assert metrics.truncated_share == 0.5
        losses.append(metrics.policy_loss)
    # -(0.5 * 3 tokens - 0.5 * 2 tokens) / (4 samples * 6 max_new_tokens), at ratio 1
    assert losses == pytest.approx([-0.5 / 24] * 2, rel=1e-4)


def assert_same_policy(one: Learner, two: Learner) -> None:
    for (name, a), b in zip(
        one.engine.policy.state_dict().items(),
        two.engine.policy.state_dict().values(),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_two_micro_batches_give_the_same_update_as_one(model_path, device):
    one = make_learner(model_path, device, algorithm__advantage="grpo", learner__micro_batch_size=4)
    two = make_learner(model_path, device, algorithm__advantage="grpo", learner__micro_batch_size=2)
    episodes = {"46": 1.0, "4": 0.0, "4600": 0.0, "57": 0.5}  # unequal lengths
    one.train_step(episodes_for(one, episodes))
    two.train_step(episodes_for(two, episodes))
    assert_same_policy(one, two)


def test_gradient_checkpointing_gives_the_same_update(model_path, device):
    plain = make_learner(model_path, device, algorithm__advantage="grpo")
    recomputed = make_learner(
        model_path, device, algorithm__advantage="grpo", learner__gradient_checkpointing=True
    )
    assert recomputed.engine.policy.is_gradient_checkpointing
    # Checkpointing computes every row whole (no KV cache to share a prompt through), so
    # the plain learner does too: with shared prompts the sums run in another order, and
    # Adam's first step (about lr x the gradient's sign) turns a rounding difference in a
    # near-zero gradient into a tenth of an update (1.9e-6 measured on an AMD EPYC).
    plain.engine.share_prompts = False
    plain.train_step(episodes_for(plain, REWARDS))
    recomputed.train_step(episodes_for(recomputed, REWARDS))
    assert_same_policy(plain, recomputed)


def test_compiled_layers_compute_what_plain_layers_do(model_path, device):
    """learner.compile: every decoder layer runs compiled, and the logprobs, their
    gradients and a step's loss are the plain layers' (up to float rounding: the fused
    kernels sum in another order)."""
    # one update a step: no pass without gradients, so one graph to compile
    fields = {"algorithm__advantage": "grpo", "learner__epochs": 1}
    plain = make_learner(model_path, device, **fields)
    compiled = make_learner(model_path, device, learner__compile=True, **fields)
    layers = decoder_layers(compiled.engine.policy)
    assert len(layers) == compiled.engine.policy.config.num_hidden_layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    # rows of unequal lengths: padding on both sides, as a micro-batch has
    batch = collate([[5, 6, 7], [8]], [[9], [10, 11, 12]], pad_token_id=0).to(plain.engine.device)
    logps, grads = [], []
    for learner in (plain, compiled):
        learner.engine.policy.zero_grad()
        logp = learner.engine.forward(batch).logp * batch.mask
        logp.sum().backward()
        logps.append(logp.detach())
        grads.append([p.grad.clone() for p in learner.engine.policy.parameters()])
    torch.testing.assert_close(logps[1], logps[0])
    for plain_grad, compiled_grad in zip(*grads, strict=True):
        torch.testing.assert_close(compiled_grad, plain_grad, atol=1e-5, rtol=1e-4)
    steps = [learner.train_step(episodes_for(learner, REWARDS)) for learner in (plain, compiled)]
    assert steps[1].grad_norm == pytest.approx(steps[0].grad_norm, rel=1e-4)
    # on-policy, the loss is -mean(advantage x ratio) with ratios of 1 and advantages of
    # mean 0: about 0, give or take float32's rounding of the ratios (1e-7 each)
    assert steps[1].policy_loss == pytest.approx(steps[0].policy_loss, abs=1e-6)


def test_an_offloaded_optimizer_state_trains_as_if_it_had_stayed(model_path, device):
    """The engine's turn in the colocated placement (learner.offload_optimizer): AdamW's
    moments go to host memory, freeing their bytes on a GPU, and come back for the next
    step, which is the step of a learner that kept them."""
    kept = make_learner(model_path, device, algorithm__advantage="grpo")
    moved = make_learner(
        model_path, device, algorithm__advantage="grpo", learner__offload_optimizer=True
    )
    for step in range(3):
        for learner in (kept, moved):
            learner.train_step(episodes_for(learner, REWARDS))
        moments = sum(  # their bytes (a list of them would keep them on the device)
            t.numel() * t.element_size()
            for s in moved.engine.optimizer.state.values()
            for n, t in s.items()
            if n != "step"
        )
        on_device = torch.cuda.memory_allocated() if device == "cuda" else 0
        moved.release_device()
        state = moved.engine.optimizer.state.values()
        assert all(t.device.type == "cpu" for s in state for t in s.values())
        if device == "cuda":
            freed = on_device - torch.cuda.memory_allocated()
            assert freed >= moments > 0
            assert all(t.is_pinned() for s in state for n, t in s.items() if n != "step")
        if step == 1:  # the learner's turn; otherwise the step brings them back itself
            moved.reclaim_device()
            assert all(t.device.type == device for s in state for n, t in s.items() if n != "step")
    assert_same_policy(kept, moved)
    for a, b in zip(kept.engine.optimizer.state.values(), state, strict=True):
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"].to(device))


def test_a_micro_batch_computes_no_column_that_all_its_rows_pad():
    # Prompts left-padded to 3 columns, completions right-padded to 3.
    batch = collate([[1, 2, 3], [4]], [[5], [6, 7, 8]], pad_token_id=0)
    short_prompt = batch.trimmed(torch.tensor([1]))
    assert short_prompt.input_ids.tolist() == [[4, 6, 7, 8]]
    assert short_prompt.position_ids.tolist() == [[0, 1, 2, 3]]
    assert short_prompt.completion_ids.tolist() == [[6, 7, 8]]
    short_completion = batch.trimmed(torch.tensor([0]))
    assert short_completion.input_ids.tolist() == [[1, 2, 3, 5]]
    assert short_completion.mask.tolist() == [[1.0]]
    assert batch.trimmed(torch.tensor([1, 0])).input_ids.tolist() == [
        [0, 0, 4, 6, 7, 8],
        [1, 2, 3, 5, 0, 0],
    ]
    # Outputs go back to the batch's columns, zeros where no row of them had a token.
    outputs = Outputs(logp=torch.tensor([[-1.0]]), values=torch.tensor([[0.5]])).widened(3)
    assert outputs.logp.tolist() == [[-1.0, 0.0, 0.0]] and outputs.entropy is None
    assert outputs.values.tolist() == [[0.5, 0.0, 0.0]]


def update_gradient(learner: Learner, episodes: list[Episode]) -> dict[str, torch.Tensor]:
    """Runs a step of one update and returns the policy's gradient just before it."""
    gradients: dict[str, torch.Tensor] = {}
    update = learner.engine._optimizer_step

    def read_then_update() -> float:
        for name, parameter in learner.engine.policy.named_parameters():
            gradients[name] = parameter.grad.clone()
        return update()

    learner.engine._optimizer_step = read_then_update
    learner.train_step(episodes)
    return gradients


@pytest.mark.parametrize("aggregation", typing.get_args(LossAggregation))
def test_token_budget_micro_batches_give_the_padded_batchs_gradient(
    model_path, device, aggregation
):
    # Completions of 2 to 41 tokens: one micro-batch padded to the longest (as every
    # micro-batch was before) against micro-batches of at most 64 tokens, padding
    # included, each on its own columns.
    completions = {"4": 1.0, "46": 0.0, "4" * 20: 0.5, "5" * 40: 0.0}
    learners = {
        budget: make_learner(
            model_path,
            device,
            algorithm__advantage="grpo",
            algorithm__loss_aggregation=aggregation,
            learner__epochs=1,
            learner__micro_batch_tokens=budget,
        )
        for budget in (0, 64)
    }
    gradients = {
        budget: update_gradient(learner, episodes_for(learner, completions))
        for budget, learner in learners.items()
    }
    # Float summation order only, so the tolerance scales with the gradient: measured at
    # most 3.8e-6 on gradients up to 38 (seq_mean_token_sum, AVX2) and 2.4e-7 on
    # gradients up to 2.3 (token_mean); a masking error is of the gradient's own size.
    largest = max(g.abs().max().item() for g in gradients[0].values())
    for name, padded in gradients[0].items():
        torch.testing.assert_close(
            gradients[64][name], padded, atol=1e-6 * max(1.0, largest), rtol=1e-5, msg=name
        )
    assert largest > 1e-3  # a real gradient
    assert_same_policy(learners[0], learners[64])


def test_rows_that_share_a_prompt_are_found_when_that_saves_enough():
    # Three rows of [1, 2, 3] and one of [4], left-padded to 3 columns with pad id 0.
    batch = collate([[1, 2, 3], [4], [1, 2, 3], [1, 2, 3]], [[5], [6], [7], [8]], 0)
    shared = shared_prompts(batch)
    assert shared is not None
    assert sorted(shared.firsts.tolist()) == [0, 1]
    assert shared.firsts[shared.of_row].tolist() == [0, 1, 0, 0]
    # A prompt that begins with the pad id is not its shorter, padded neighbour.
    batch = collate([[0, 5], [5], [0, 5], [5]], [[6], [6], [7], [7]], 0)
    shared = shared_prompts(batch)
    assert shared is not None and shared.firsts[shared.of_row].tolist() == [0, 1, 0, 1]
    # Long completions after a short shared prompt: a quarter of the positions is not
    # saved (3 of 4 prompts of 2 columns, against 4 rows of 10 columns).
    assert shared_prompts(collate([[1, 2]] * 4, [[5] * 8] * 4, 0)) is None
    assert shared_prompts(collate([[1, 2], [3, 4]], [[5], [6]], 0)) is None


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_a_prompt_run_once_for_its_group_gives_the_same_logprobs_and_gradient(
    model_path, device, aggregation
):
    """Each distinct prompt of a micro-batch runs once and its rows read its keys and
    values: the logprobs, the gradient and the update are those of every row run whole,
    and the learner counts the positions it computed."""
    learners = {
        share: make_learner(
            model_path,
            device,
            algorithm__advantage="grpo",
            algorithm__loss_aggregation=aggregation,
            learner__epochs=1,
            learner__episodes_per_step=8,
            learner__minibatch_size=8,
            learner__micro_batch_size=8,
        )
        for share in (False, True)
    }
    learners[False].engine.share_prompts = False
    assert learners[True].engine.share_prompts

    def episodes(learner: Learner) -> list[Episode]:  # two prompts of unequal lengths
        return episodes_for(learner, REWARDS) + episodes_for(
            learner, {"5": 1.0, "13": 0.0, "4": 0.0, "22": 0.5}, prompt="2+3=", prompt_index=1
        )

    logprobs = {share: learner.logprobs(episodes(learner)) for share, learner in learners.items()}
    # Float summation order only: at most 1.4e-6 measured (AVX-512), against the 1e-5 of
    # the parity check; a wrong key, value or position moves a logprob by tenths.
    for whole, shared in zip(logprobs[False], logprobs[True], strict=True):
        torch.testing.assert_close(torch.tensor(shared), torch.tensor(whole), atol=1e-5, rtol=0)
    steps = {}
    gradients = {}
    for share, learner in learners.items():
        update = learner.engine._optimizer_step
        gradients[share] = {}

        def read_then_update(learner=learner, share=share, update=update) -> float:
            for name, parameter in learner.engine.policy.named_parameters():
                gradients[share][name] = parameter.grad.clone()
            return update()

        learner.engine._optimizer_step = read_then_update
        steps[share] = learner.train_step(episodes(learner))
    largest = max(g.abs().max().item() for g in gradients[False].values())
    assert largest > 1e-3  # a real gradient
    for name, whole in gradients[False].items():
        torch.testing.assert_close(
            gradients[True][name], whole, atol=1e-6 * max(1.0, largest), rtol=1e-5, msg=name
        )
    assert_same_policy(learners[False], learners[True])
    # One pass (fused) over one micro-batch of 8 rows of 6 prompt and 3 completion
    # columns: 72 positions whole; 2 x 6 + 8 x 3 = 36 with each prompt once. Padding:
    # "2+3=" is 2 short of "12+34=" (in 4 rows, or once), 2 completions 1 short of 3.
    assert (steps[False].learner_tokens_computed, steps[False].learner_padding_tokens) == (72, 10)
    assert (steps[True].learner_tokens_computed, steps[True].learner_padding_tokens) == (36, 4)


def test_micro_batches_hold_whole_groups_when_their_prompts_are_shared(model_path, device):
    learner = make_learner(
        model_path,
        device,
        algorithm__advantage="grpo",
        learner__epochs=1,
        learner__episodes_per_step=8,
        learner__minibatch_size=8,
        learner__micro_batch_size=4,
    )
    # Completions of 3 and 2 tokens in both groups: ordered by length alone, each
    # micro-batch would mix the two prompts.
    episodes = episodes_for(learner, {"46": 1.0, "5": 0.0, "57": 0.0, "4": 0.0}) + episodes_for(
        learner, {"13": 1.0, "22": 0.0, "4": 0.0, "31": 0.5}, prompt="2+3=", prompt_index=1
    )
    step = learner.train_step(episodes)
    # One pass (fused), a micro-batch a group: 6 + 4 x 3 for "12+34=", 4 + 4 x 3 for
    # "2+3=" (mixed: 2 x 6 + 4 x 3 each, 48 in all).
    assert step.learner_tokens_computed == 18 + 16


def test_a_step_reports_the_padding_its_learner_computed(model_path, device):
    completions = {"4": 1.0, "46": 0.0, "4" * 20: 0.5, "5" * 40: 0.0}
    padded = make_learner(model_path, device, algorithm__advantage="grpo", learner__epochs=1)
    budget = make_learner(
        model_path,
        device,
        algorithm__advantage="grpo",
        learner__epochs=1,
        learner__micro_batch_tokens=64,
    )
    one = padded.train_step(episodes_for(padded, completions))
    many = budget.train_step(episodes_for(budget, completions))
    tokens = sum(
        len(e.prompt_token_ids) + len(e.completion_token_ids)
        for e in episodes_for(padded, completions)
    )
    # One pass (fused): the computed positions are the real tokens and the padding.
    assert one.learner_tokens_computed - one.learner_padding_tokens == tokens
    assert many.learner_tokens_computed - many.learner_padding_tokens == tokens
    # Completions of 2, 3, 21 and 41 tokens after a 6-token prompt: 4 rows padded to 47
    # columns, against 3 micro-batches of at most 64: 47; 2 x 27 (3 x 27 is over); 8.
    assert one.learner_tokens_computed == 4 * 47
    assert many.learner_tokens_computed == 47 + 2 * 27 + 8
    assert many.learner_padding_tokens < one.learner_padding_tokens / 2


def test_a_learner_trains_on_the_cores_an_idle_rollout_worker_lends(model_path, device, tmp_path):
    """learner.borrow_idle_cores: each micro-batch runs on the learner's own threads plus
    one per core its node's rollout workers lend while idle, and makes the same update."""
    run_id = f"test-{tmp_path.name}"
    worker = CoreLender(run_id, "rollout-0", cores=1)  # posts itself idle
    fields = {"algorithm__advantage": "grpo", "learner__micro_batch_tokens": 64}
    own = torch.get_num_threads()
    plain = make_learner(model_path, device, **fields)
    lending = make_learner(model_path, device, lent_cores=IdleCores(run_id).idle, **fields)
    completions = {"4": 1.0, "46": 0.0, "4" * 20: 0.5, "5" * 40: 0.0}  # 3 micro-batches
    try:
        step = lending.train_step(episodes_for(lending, completions))
        assert torch.get_num_threads() == own + 1
        assert step.learner_borrowed_tokens == step.learner_tokens_computed > 0
        plain.train_step(episodes_for(plain, completions))
        assert_same_policy(plain, lending)
        with worker.busy():  # generating: its core is its own again
            step = lending.train_step(episodes_for(lending, completions))
            assert torch.get_num_threads() == own
        assert step.learner_borrowed_tokens == 0 < step.learner_tokens_computed
    finally:
        torch.set_num_threads(own)
        IdleCores(run_id).remove()


def test_a_group_split_across_steps_is_refused(model_path, device):
    learner = make_learner(model_path, device, algorithm__advantage="grpo")
    three_of_four = episodes_for(learner, REWARDS)[:3]
    with pytest.raises(ValueError, match="prompt 0 reached the learner with 3 of its 4 samples"):
        learner.train_step(three_of_four)


def test_stale_and_posted_episodes_are_corrected_and_counted(model_path, device):
    learner = make_learner(model_path, device, algorithm__advantage="grpo")
    episodes = episodes_for(learner, REWARDS)
    # vLLM's logprobs 0.5 above the learner's on one episode (a stale policy), unknown on
    # a posted one: the first is weighted exp(-0.5), the second trained at ratio 1.
    stale, posted = episodes[0], episodes[1]
    stale.rollout_logprobs = [lp + 0.5 for lp in stale.rollout_logprobs]
    stale.policy_version = posted.policy_version = -1
    posted.rollout_logprobs = []
    metrics = learner.train_step(episodes)
    assert metrics.episodes_without_logprobs == 1
    tokens = [len(e.completion_token_ids) for e in episodes]
    known_tokens = sum(tokens) - tokens[1]
    assert metrics.rollout_logprob_diff_max == pytest.approx(0.5, abs=1e-5)
    # Each also holds the learner's own parity error (up to 1e-6 a token, measured).
    assert metrics.rollout_logprob_diff_mean == pytest.approx(
        0.5 * tokens[0] / known_tokens, abs=1e-5
    )
    weight = (tokens[0] * torch.exp(torch.tensor(-0.5)).item() + sum(tokens[1:])) / sum(tokens)
    assert metrics.rollout_correction_weight_mean == pytest.approx(weight, rel=1e-5)
    assert metrics.logprob_parity_error < 1e-5  # from the fresh episodes only


def test_bfloat16_trains_with_float32_master_weights(model_path, device):
    learner = make_learner(model_path, device, model__dtype="bfloat16", algorithm__advantage="grpo")
    reference = make_learner(model_path, device, algorithm__advantage="grpo")
    episodes = episodes_for(reference, REWARDS)
    # bf16 arithmetic against fp32: the logprobs of the same weights differ a little.
    # bf16 keeps 8 significant bits: a logit of 8 rounds by up to 0.03, and a token's
    # logprob carries its logit's error and the normaliser's. The largest gap over the
    # tokens was 0.045 on a 2-core Xeon and 0.064 on an H200 (2026-11-28), against a
    # bound of 0.05 before; a learner that read other weights is off by far more.
    tolerance = 0.1
    gap = max(
        abs(a - b)
        for x, y in zip(learner.logprobs(episodes), reference.logprobs(episodes), strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert 0 < gap < tolerance
    # Parity against a float32 forward pass of the masters: the same bf16 gap.
    assert_moves_toward_rewarded(learner, parity=tolerance)
    assert all(p.dtype == torch.float32 for p in learner.engine.policy.parameters())
    state = learner.engine.optimizer.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    published = learner.published_weights()
    assert {t.dtype for t in published.values()} == {torch.bfloat16}


def test_padding_in_a_batch_changes_no_logprob(model_path, device):
    learner = make_learner(model_path, device)
    short, long = episodes_for(learner, {"4": 0.0, "46000": 0.0})
    together = learner.logprobs([short, long])[0]
    alone = learner.logprobs([short])[0]
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), atol=1e-5, rtol=0)
    batch = collate(
        [short.prompt_token_ids, long.prompt_token_ids],
        [short.completion_token_ids, long.completion_token_ids],
        learner.pad_token_id,
    )
    assert batch.mask.sum(dim=1).tolist() == [2.0, 6.0]


def two_turn_episodes(learner: Learner, observation: str, garbage: float) -> list[Episode]:
    """REWARDS' episodes as two turns: the first digit, an observation the rollout
    appended (mask 0, rollout logprob `garbage`), then the rest and end of sequence."""
    tok = learner.tokenizer
    episodes = episodes_for(learner, REWARDS)
    for e in episodes:
        first, rest = e.completion_token_ids[:1], e.completion_token_ids[1:]
        seen = tok(observation).input_ids
        e.completion_token_ids = [*first, *seen, *rest]
        e.completion_mask = [1] * len(first) + [0] * len(seen) + [1] * len(rest)
    for e, logprobs in zip(episodes, plain_logprobs(learner.engine.policy, episodes), strict=True):
        pairs = zip(logprobs, e.completion_mask, strict=True)
        e.rollout_logprobs = [lp if policy else garbage for lp, policy in pairs]
    return episodes


def test_observation_tokens_are_context_but_never_trained_or_parity_checked(model_path, device):
    learners = [make_learner(model_path, device, algorithm__advantage="grpo") for _ in range(3)]
    one, two, unmasked = learners
    metrics = one.train_step(two_turn_episodes(one, "+1=", garbage=-30.0))
    # Parity covers the policy's tokens only: the observation's garbage logprobs (30 nats
    # off) would show, and would also weight the loss through rollout correction.
    assert metrics.logprob_parity_error < 1e-5
    two.train_step(two_turn_episodes(two, "+1=", garbage=0.0))
    assert_same_policy(one, two)
    # The same tokens all counted as the policy's train differently.
    episodes = two_turn_episodes(unmasked, "+1=", garbage=0.0)
    for e, logprobs in zip(episodes, plain_logprobs(unmasked.engine.policy, episodes), strict=True):
        e.completion_mask, e.rollout_logprobs = [], logprobs
    unmasked.train_step(episodes)
    with pytest.raises(AssertionError):
        assert_same_policy(one, unmasked)


def test_a_sync_is_checked_on_the_steps_own_episodes_at_temperature_one(model_path, device):
    # Sampling at 0.7, the learner still gives temperature-1 logprobs for the check:
    # what vLLM gives tokens fed to it as a prompt (RolloutWorker.parity_gap).
    learner = make_learner(model_path, device, temperature=0.7)
    learner.train_step(two_turn_episodes(learner, "+1=", garbage=0.0))
    sample = learner.parity_sample()
    assert [e.episode_id for e in sample.episodes] == ["t-0-0", "t-0-1"]  # the step's own
    assert sample.version == learner.version
    engine = plain_logprobs(learner.engine.policy, sample.episodes)  # the weights after
    # An engine off by 30 nats on an observation token, which the policy never sampled.
    engine[0][1] -= 30.0
    assert sample.episodes[0].completion_mask[1] == 0
    assert parity_gap(sample, engine) < 1e-5
    # One policy token 0.25 off: what a weight sync that went wrong shows.
    engine[1][-1] += 0.25
    assert parity_gap(sample, engine) == pytest.approx(0.25, abs=1e-5)
    # A next batch of an older version cannot show parity: the step reports none, and
    # the driver reports the sync's check in its place.
    stale = two_turn_episodes(learner, "+1=", garbage=0.0)
    for e in stale:
        e.policy_version = learner.version - 1
    assert learner.train_step(stale).logprob_parity_error is None


def test_checkpoint_restores_weights_optimizer_version_and_cursor(model_path, device, tmp_path):
    learner = make_learner(model_path, device, algorithm__advantage="gae")
    learner.train_step(episodes_for(learner, {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}))
    saved = learner.save_checkpoint(tmp_path, prompt_cursor=1234)
    assert latest_checkpoint(tmp_path) == saved
    restored = make_learner(model_path, device, str(saved), algorithm__advantage="gae")
    assert restored.state() == {"version": 1, "prompt_cursor": 1234}
    for (name, a), b in zip(
        learner.engine.policy.state_dict().items(),
        restored.engine.policy.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    assert torch.equal(learner.engine.critic.head.weight, restored.engine.critic.head.weight)
    original = learner.engine.optimizer.state_dict()["state"]
    loaded = restored.engine.optimizer.state_dict()["state"]
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k]["exp_avg"], loaded[k]["exp_avg"]) for k in original)
    # The next step is the same step either way.
    episodes = {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}
    one = learner.train_step(episodes_for(learner, episodes))
    two = restored.train_step(episodes_for(restored, episodes))
    assert (one.policy_loss, one.value_loss) == pytest.approx(
        (two.policy_loss, two.value_loss), rel=1e-6
    )


def test_a_staged_checkpoint_is_resumable_only_once_kept(model_path, device, tmp_path):
    # A step's checkpoint taken before its evaluation (eval.beside_training): whole, but
    # neither resumed from nor the latest until the verdict keeps it; a discarded one is gone.
    learner = make_learner(model_path, device)
    first = learner.save_checkpoint(tmp_path, prompt_cursor=8)
    learner.train_step(episodes_for(learner, {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}))
    staged = learner.save_checkpoint(tmp_path, prompt_cursor=40, publish=False)
    assert staged.name == ".staging-000001" and checkpoint_problem(staged) is None
    assert latest_checkpoint(tmp_path) == first
    kept = learner.publish_staged(tmp_path, 1, keep=True)
    assert kept == tmp_path / "checkpoints" / "step-000001" and not staged.exists()
    assert latest_checkpoint(tmp_path) == kept
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-000001"
    resumed = make_learner(model_path, device, str(kept))
    assert resumed.state() == {"version": 1, "prompt_cursor": 40}
    learner.train_step(episodes_for(learner, {"46": 1.0, "45": 0.0, "47": 0.0, "56": 0.0}))
    staged = learner.save_checkpoint(tmp_path, prompt_cursor=72, publish=False)
    assert learner.publish_staged(tmp_path, 2, keep=False) is None
    assert not staged.exists() and latest_checkpoint(tmp_path) == kept
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step-000000",
        "step-000001",
    ]


def parameters(learner: Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.engine.policy.parameters()]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reward": 1e308}, "step 1: episodes[2].reward: 1e+308 is beyond ±1e+15"),
        ({"reward": float("nan")}, "step 1: episodes[2].reward: nan is not finite"),
        (
            {"completion_token_ids": [5, 20]},
            "episodes[2].completion_token_ids[1]: token id 20 is outside the model's "
            "vocabulary (0 to 19)",
        ),
        (
            {"completion_token_ids": [5] * 60},
            "6 prompt + 60 completion tokens exceed the context window (model.max_model_len=64)",
        ),
        (
            {"prompt_token_ids": [2**31]},
            "episodes[2].prompt_token_ids[0]: 2147483648 is outside int32",
        ),
    ],
)
def test_a_bad_episode_stops_the_step_naming_it_and_updates_nothing(
    model_path, device, change, message
):
    learner = make_learner(model_path, device, algorithm__advantage="grpo")
    episodes = episodes_for(learner, REWARDS)
    for name, value in change.items():
        setattr(episodes[2], name, value)
    if "completion_token_ids" in change:
        episodes[2].rollout_logprobs = [-1.0] * len(change["completion_token_ids"])
    before = parameters(learner)
    with pytest.raises(EpisodeError) as caught:
        learner.train_step(episodes)
    assert message in str(caught.value)
    assert learner.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(learner), strict=True))


def test_a_non_finite_loss_stops_the_step_before_its_update(model_path, device):
    # A learning rate of 1e37 takes the weights to the edge of float32 in one update: the
    # second epoch's logits overflow, and its loss is NaN, or (measured on another build of
    # the tiny model) its loss is finite but the gradient is NaN. That update is never taken.
    learner = make_learner(model_path, device, learner__lr=1e37, learner__epochs=2)
    not_finite = r"^step 1: (loss|policy gradient norm) is not finite \(nan"
    with pytest.raises(NonFiniteError, match=not_finite):
        learner.train_step(episodes_for(learner, REWARDS))
    assert learner.version == 0
    assert not any(torch.isnan(p).any() for p in parameters(learner))


def test_a_non_finite_gradient_is_never_applied(model_path, device):
    # A finite loss whose backward overflows leaves inf/NaN gradients: the optimizer
    # step is refused and the weights stay as they were.
    learner = make_learner(model_path, device)
    engine = learner.engine
    before = [p.detach().clone() for p in parameters(learner)]
    for p in engine.policy.parameters():
        p.grad = torch.full_like(p, float("inf"))
    with pytest.raises(NonFiniteError, match="policy gradient norm is not finite"):
        engine._optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(learner), strict=True))
    assert all(p.grad is None for p in engine.policy.parameters())


def test_one_update_per_step_takes_the_logprobs_before_it_from_its_own_forward_pass(
    model_path, device
):
    """One epoch of one mini-batch: the logprobs before the update are the update's own
    forward pass's, so the step saves a pass, and updates as the step that makes one."""
    fused = make_learner(model_path, device, algorithm__advantage="grpo", learner__epochs=1)
    apart = make_learner(model_path, device, algorithm__advantage="grpo", learner__epochs=1)
    apart.fuse_old_logprobs = False
    assert fused.fuses_old_logprobs(4) and not apart.fuses_old_logprobs(4)
    # Two updates a step, a critic or a reference need the pass.
    assert not make_learner(model_path, device).fuses_old_logprobs(4)  # 2 epochs
    gae = make_learner(model_path, device, algorithm__advantage="gae", learner__epochs=1)
    assert not gae.fuses_old_logprobs(4)
    passes = []
    score = fused.engine.score
    fused.engine.score = lambda *args, **kwargs: passes.append(1) or score(*args, **kwargs)
    results = []
    for learner in (fused, apart):
        episodes = episodes_for(learner, REWARDS)
        # A stale episode: its rollout correction is computed from the fused logprobs too.
        episodes[1].rollout_logprobs = [lp + 0.3 for lp in episodes[1].rollout_logprobs]
        episodes[1].policy_version = -1
        results.append(learner.train_step(episodes))
    assert passes == []  # the fused step made no pass of its own
    one, two = results
    keys = ("reward_mean", "policy_loss", "entropy", "clip_fraction", "grad_norm")
    keys += ("advantage_abs_mean", "rollout_correction_weight_mean", "rollout_logprob_diff_max")
    assert {k: getattr(one, k) for k in keys} == pytest.approx(
        {k: getattr(two, k) for k in keys}, rel=1e-5, abs=1e-6
    )
    assert one.logprob_parity_error < 1e-5
    for (name, a), b in zip(
        fused.engine.policy.named_parameters(), apart.engine.policy.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_minibatch_size_zero_is_one_update_an_epoch_however_many_episodes_a_step_holds(
    model_path, device
):
    # Agent traces make steps of more episodes than learner.episodes_per_step (4 here).
    whole = make_learner(model_path, device, learner__minibatch_size=0)
    fours = make_learner(model_path, device)  # mini-batches of 4
    for learner, updates in ((whole, 2), (fours, 4)):
        episodes = episodes_for(learner, REWARDS) + episodes_for(learner, REWARDS, "9+9=", 1)
        assert learner.train_step(episodes).optimizer_updates == updates  # 2 epochs
