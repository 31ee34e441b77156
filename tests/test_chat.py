"""Chat-formatted prompts: JSONL parsing, rendering by the chat template, prompt checks on
the rendered tokens, stop settings in vLLM and rewards in TRL's conversational shape."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest

from rlray.config import BUILTIN_MODEL, Config, ConfigError, RewardSpec, validate
from rlray.core.episode import ModelLimits
from rlray.core.prompt import PromptRow
from rlray.data.chat import MESSAGES_COLUMN, accepts_chat, render_prompt, reward_inputs
from rlray.data.models import load_tokenizer, read_prompts, resolve_model_path
from rlray.data.prompts import eval_rows, read_jsonl
from rlray.data.tiny_models import CHAR_CHAT_TEMPLATE, build_char_tokenizer
from rlray.driver.plan import _check_stop_token_ids, plan_run
from rlray.rewards.text import exact_match, numeric_match
from rlray.rewards.worker import RewardWorker
from tests.rollout_host import ROLLOUT, rollout_actor
from tests.test_episode import make_episode

USER = [{"role": "user", "content": "12+34="}]
WITH_SYSTEM = [{"role": "system", "content": "(1+1=2)"}, {"role": "user", "content": "7+8="}]


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer as vLLM loads it (from the model directory)."""
    return load_tokenizer(resolve_model_path(BUILTIN_MODEL))


def test_a_user_message_renders_to_the_tokens_of_its_text(tokenizer):
    chat, text = render_prompt(tokenizer, USER), render_prompt(tokenizer, "12+34=")
    assert chat.text == "12+34="
    assert chat.token_ids == text.token_ids == tokenizer("12+34=").input_ids


def test_system_and_assistant_messages_render_by_the_template(tokenizer):
    rendered = render_prompt(tokenizer, WITH_SYSTEM)
    assert rendered.text == "(1+1=2)7+8="
    assert rendered.token_ids == tokenizer("(1+1=2)7+8=").input_ids
    shot = [*USER, {"role": "assistant", "content": "46"}, {"role": "user", "content": "1+2="}]
    rendered = render_prompt(tokenizer, shot)
    eos = tokenizer.eos_token_id
    assert rendered.token_ids == [
        *tokenizer("12+34=46").input_ids,
        eos,
        *tokenizer("1+2=").input_ids,
    ]
    # The template's own tokenisation gives the same ids (no special tokens added twice).
    assert rendered.token_ids == list(
        tokenizer.apply_chat_template(shot, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def test_a_template_that_writes_the_bos_token_gets_no_second_one():
    from tokenizers.processors import TemplateProcessing

    with_bos = build_char_tokenizer()  # a tokenizer that adds a BOS (<pad> here) to text
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<pad> $A", special_tokens=[("<pad>", 0)]
    )
    with_bos.bos_token = "<pad>"
    with_bos.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text, chat = (
        render_prompt(with_bos, "1+2="),
        render_prompt(with_bos, [USER[0] | {"content": "1+2="}]),
    )
    assert chat.text == "<pad>1+2="
    assert chat.token_ids == text.token_ids == [0, *build_char_tokenizer()("1+2=").input_ids]


def test_messages_without_a_chat_template_are_a_config_error(tokenizer):
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        render_prompt(bare, USER)
    assert render_prompt(bare, "1+2=").text == "1+2="  # text needs no template


def test_the_embedded_model_directory_holds_the_chat_template(tokenizer):
    assert tokenizer.chat_template == CHAR_CHAT_TEMPLATE
    assert build_char_tokenizer().chat_template == CHAR_CHAT_TEMPLATE


def _jsonl(path: Path, *prompts) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return str(path)


def test_jsonl_rows_may_be_text_or_messages(tmp_path):
    rows = read_jsonl(_jsonl(tmp_path / "d.jsonl", "1+2=", WITH_SYSTEM), "data.train")
    assert [r.prompt for r in rows] == ["1+2=", WITH_SYSTEM]
    assert rows[1].columns == {"answer": "1"}


BAD_MESSAGES = {
    "not-a-list": (5, "'prompt' must be a string or a list of messages, got int"),
    "empty": ([], "'prompt' is an empty list of messages"),
    "not-objects": ([["user", "1+1="]], "message 0 is a list, not an object"),
    "no-content": ([{"role": "user"}], "message 0 has keys ['role']; expected exactly"),
    "extra-key": ([{"role": "user", "content": "x", "name": "a"}], "expected exactly role"),
    "number-content": ([{"role": "user", "content": 5}], "role and content must be strings"),
    "unknown-role": (
        [{"role": "user", "content": "1"}, {"role": "robot", "content": "x"}],
        "message 1 has role 'robot'; known: system, user, assistant, tool",
    ),
    "prefilled-reply": (
        [*USER, {"role": "assistant", "content": "4"}],
        "ends with an assistant message; a prefilled reply is not continued",
    ),
}


@pytest.mark.parametrize(("prompt", "message"), BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_bad_message_lists_name_file_and_line(tmp_path, prompt, message):
    path = _jsonl(tmp_path / "bad.jsonl", "1+2=", prompt)
    with pytest.raises(ConfigError) as raised:
        read_jsonl(path, "data.train")
    text = str(raised.value)
    assert text.startswith(f"{path}:2: ") and message in text
    assert "\n" not in text


def test_a_chat_row_may_not_have_the_messages_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": USER, MESSAGES_COLUMN: []}) + "\n")
    with pytest.raises(ConfigError, match=":1: 'prompt' is chat messages, so the row may not"):
        read_jsonl(str(path), "data.train")


def test_prompt_checks_count_the_rendered_tokens(tmp_path):
    # A system message long enough that the rendering, not the user's 4 tokens, is too
    # long (64 tokens - 6 new tokens leaves 58 for the prompt).
    long_system = [{"role": "system", "content": "1+" * 27 + "1"}, WITH_SYSTEM[1]]
    train = [USER, WITH_SYSTEM, [*USER, *USER], long_system]
    config = Config()
    config.data.train = _jsonl(tmp_path / "train.jsonl", *train)
    config.run_dir = str(tmp_path / "run")
    held_out = [r.prompt for r in eval_rows(config.data)]
    # The lists plan_run reads, so that it finds these readings cached (one child process).
    train_read, _ = read_prompts(resolve_model_path(BUILTIN_MODEL), [train, held_out])
    assert [r.count for r in train_read] == [6, 11, 12, 59]  # "12+34=", "(1+1=2)7+8=", ...
    assert [r.read_as for r in train_read] == [None] * 4
    with pytest.raises(ConfigError, match=r"data.train: prompt 'user: 7\+8=' is 59 tokens; with"):
        plan_run(config, None)


def test_stop_settings_are_validated():
    config = Config()
    config.rollout.stop = ["\n", ""]
    with pytest.raises(ConfigError, match=r"rollout.stop\[1\] is empty"):
        validate(config)
    config = Config()
    config.rollout.stop_token_ids = [1, -3]
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids\[1\] must be >= 0, got -3"):
        validate(config)
    with pytest.raises(ConfigError, match=r"stop_token_ids\[0\]: 20 is not a token id .*of 20"):
        _check_stop_token_ids([20], ModelLimits(vocab_size=20, max_model_len=64))
    _check_stop_token_ids([19], ModelLimits(vocab_size=20, max_model_len=64))


# --- rewards in TRL's shape ---

REWARD_FILE = """
def shapes(prompts, completions, answer, **columns):
    assert "prompt_messages" not in columns  # the messages arrive as the prompt, as in TRL
    return [
        10.0 * isinstance(p, list) + (c == [{"role": "assistant", "content": a}])
        if isinstance(c, list)
        else float(isinstance(p, str) and isinstance(c, str) and c == a)
        for p, c, a in zip(prompts, completions, answer)
    ]
"""


def _episodes() -> list:
    chat = make_episode(
        episode_id="chat", prompt="(1+1=2)7+8=", completion="15", reward=None,
        columns={"answer": "15", MESSAGES_COLUMN: WITH_SYSTEM}, reward_components={},
    )  # fmt: skip
    text = make_episode(
        episode_id="text", prompt="7+8=", completion="15", reward=None,
        columns={"answer": "15"}, reward_components={},
    )  # fmt: skip
    return [chat, text]


def test_rewards_get_chat_episodes_in_trl_shape_and_text_ones_as_text(tmp_path):
    prompts, completions = reward_inputs(_episodes())
    assert prompts == [WITH_SYSTEM, "7+8="]
    assert completions == [[{"role": "assistant", "content": "15"}], "15"]
    (tmp_path / "shaped.py").write_text(REWARD_FILE)
    specs = [RewardSpec(name=f"{tmp_path}/shaped.py:shapes"), RewardSpec(name="exact_match")]
    worker = RewardWorker("reward-0", specs)
    try:
        scored, _ = worker.score(_episodes())
    finally:
        worker.process.close()
    assert [e.reward_components[specs[0].name] for e in scored] == [11.0, 1.0]
    assert [e.reward_components["exact_match"] for e in scored] == [1.0, 1.0]


def test_built_in_rewards_take_either_shape_and_keep_their_signature():
    chat = [{"role": "assistant", "content": " 15 "}]
    assert exact_match([WITH_SYSTEM, "7+8="], [chat, "16"], answer=["15", "15"]) == [1.0, 0.0]
    assert numeric_match([USER], [[{"role": "assistant", "content": "46"}]], answer=[46]) == [1.0]
    assert "answer" in inspect.signature(exact_match).parameters  # columns are passed by it
    wrapped = accepts_chat(
        lambda prompts, completions: [p + c for p, c in zip(prompts, completions, strict=True)]
    )
    assert wrapped([USER], [chat]) == ["12+34= 15 "]


# --- vLLM: rendered token ids and stop settings (one engine, in the session's host) ---

TEXT_ROWS = [PromptRow("12+34=", {"answer": "46"}), PromptRow("7+8=", {"answer": "15"})]
CHAT_ROWS = [PromptRow(USER, {"answer": "46"}), PromptRow(WITH_SYSTEM, {"answer": "15"})]


@pytest.fixture(scope="module")
def embedded_rollout(rollout_host):
    with rollout_actor(rollout_host, Path(resolve_model_path(BUILTIN_MODEL)), "float32") as host:
        yield host


def _run(host, rows: list[PromptRow], stop: list[str], stop_token_ids: list[int], tokens: int):
    """Runs in the host process: generate and evaluate with these stop settings."""
    worker = host.rollout
    worker.rollout = dataclasses.replace(
        ROLLOUT, stop=stop, stop_token_ids=stop_token_ids, max_new_tokens=tokens
    )
    try:
        episodes, _ = worker.generate(rows, 0)
        return episodes, worker.evaluate(rows)
    finally:
        worker.rollout = ROLLOUT


def _generate(host, rows, stop=(), stop_token_ids=(), tokens=ROLLOUT.max_new_tokens):
    import ray

    call = host.__ray_call__.remote(_run, rows, list(stop), list(stop_token_ids), tokens)
    return ray.get(call, timeout=300)


def test_vllm_generates_from_the_rendered_token_ids(embedded_rollout, tokenizer):
    text_episodes, _ = _generate(embedded_rollout, TEXT_ROWS)
    chat_episodes, evaluation = _generate(embedded_rollout, CHAT_ROWS)
    for episode in chat_episodes:
        messages = CHAT_ROWS[episode.prompt_index].prompt
        rendered = render_prompt(tokenizer, messages)
        assert episode.prompt == rendered.text
        assert episode.prompt_token_ids == rendered.token_ids
        assert episode.columns == {"answer": CHAT_ROWS[episode.prompt_index].columns["answer"],
                                   MESSAGES_COLUMN: messages}  # fmt: skip
    # "12+34=" as a user message is the same tokens as the text, so the same sample.
    assert [e.completion_token_ids for e in chat_episodes[:2]] == [
        e.completion_token_ids for e in text_episodes[:2]
    ]
    # An evaluation shows a chat prompt by its last message, not its whole rendering.
    assert [shown[0] for shown in evaluation.examples] == ["12+34= ", "7+8= "]
    # Without stop settings completions run past one token (the stop tests below rely on it).
    assert max(len(e.completion_token_ids) for e in text_episodes) > 1


def test_stop_token_ids_and_stop_strings_reach_vllm(embedded_rollout, tokenizer):
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    episodes, evaluation = _generate(embedded_rollout, TEXT_ROWS, stop_token_ids=digits)
    assert [len(e.completion_token_ids) for e in episodes] == [1] * len(episodes)
    assert {e.finish_reason for e in episodes} == {"stop"}
    assert all(len(completion) <= 1 for _, completion, _ in evaluation.examples)
    episodes, evaluation = _generate(embedded_rollout, CHAT_ROWS, stop=list("0123456789"))
    assert [e.completion for e in episodes] == [""] * len(episodes)
    assert [len(e.completion_token_ids) for e in episodes] == [1] * len(episodes)
    assert [completion for _, completion, _ in evaluation.examples] == ["", ""]


def test_a_completion_decoded_at_its_end_reads_as_vllms_detokenizer_made_it(
    embedded_rollout, tokenizer
):
    # Without stop strings vLLM does not detokenize (RolloutWorker.detokenizes); a stop
    # string that never occurs turns its detokenizer on and changes nothing else.
    rows = TEXT_ROWS + CHAT_ROWS
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    reasons = set()
    for settings in ({}, {"tokens": 2}, {"stop_token_ids": digits[1:]}):
        decoded, _ = _generate(embedded_rollout, rows, **settings)
        detokenized, _ = _generate(embedded_rollout, rows, stop=["never seen"], **settings)
        assert [e.completion_token_ids for e in decoded] == [
            e.completion_token_ids for e in detokenized
        ]
        assert [e.completion for e in decoded] == [e.completion for e in detokenized]
        assert all(e.completion for e in decoded if len(e.completion_token_ids) > 1)
        reasons |= {e.finish_reason for e in decoded}
    assert reasons == {"stop", "length"}  # ended by a stop token, and cut


def _samples(host, rows: list[PromptRow], one_request: bool) -> list:
    """Runs in the host process: 4 samples of each row, a group one vLLM request of n
    (one_request: as rollout.in_flight_updates false samples them) or one each."""
    worker = host.rollout
    worker.rollout = dataclasses.replace(
        ROLLOUT, samples_per_prompt=4, in_flight_updates=not one_request
    )
    try:
        return worker.generate(rows, 10)[0]
    finally:
        worker.rollout = ROLLOUT


def test_a_group_sampled_as_one_request_draws_what_one_request_a_sample_draws(
    embedded_rollout,
):
    import ray

    rows = TEXT_ROWS + CHAT_ROWS
    grouped, apart = (
        ray.get(embedded_rollout.__ray_call__.remote(_samples, rows, one), timeout=300)
        for one in (True, False)
    )
    assert [(e.prompt_index, e.sample_index) for e in grouped] == [
        (10 + row, sample) for row in range(len(rows)) for sample in range(4)
    ]
    assert [(e.prompt_index, e.sample_index) for e in apart] == [
        (e.prompt_index, e.sample_index) for e in grouped
    ]
    assert [e.completion_token_ids for e in grouped] == [e.completion_token_ids for e in apart]
    assert [e.completion for e in grouped] == [e.completion for e in apart]
    for one, other in zip(grouped, apart, strict=True):
        assert one.rollout_logprobs == pytest.approx(other.rollout_logprobs, abs=1e-5)
        assert one.episode_id.rsplit("-", 1)[0] == other.episode_id.rsplit("-", 1)[0]
    # the samples differ: each drew with its own seed
    assert len({tuple(e.completion_token_ids) for e in grouped}) > len(rows)
    assert len({e.episode_id for e in grouped}) == len(grouped)
