"""Reward functions on completion text: pure Python plus sacrebleu, no models.

Each scores a batch the way TRL's GRPOTrainer expects,
`f(prompts, completions, **columns_and_options) -> list[float | None]`: dataset columns
(`answer`, `reference`) arrive as lists aligned with the prompts, the config's fixed options
as keyword arguments, and unknown keyword arguments are ignored. An episode that cannot be
scored (its `answer` or `reference` is None) gets None. Prompts and completions may come
as text or in TRL's conversational shape (messages; a completion is read as its last
message's content: rlray.chat.accepts_chat).

Answer match, against an `answer` column:
    exact_match         1.0 when the stripped completion equals the answer
    normalized_match    1.0 when equal after NFKC, case folding, white space and punctuation
    numeric_match       1.0 when the boxed or last number is within tolerance of the answer
Format:
    regex_match         1.0 when a regular expression matches (required tags, say)
Length:
    length_reward       [0, 1], peaks at a target length
    overlong_penalty    [-1, 0], DAPO's soft punishment near a length limit
Repetition:
    repetition_penalty  [-1, 0], minus the share of repeated word n-grams
    distinct_n          [0, 1], distinct word n-grams over all word n-grams
Script and sentiment:
    script_diversity    [0, 1], share of letters that are non-ASCII or non-Latin
    lexicon_sentiment   [-1, 1], positive minus negative lexicon words over both
Reference overlap, against a `reference` column (a string or a list of strings):
    bleu                [0, 1], sentence BLEU / 100
    chrf                [0, 1], sentence chrF / 100

Words are `\\w+` runs, case-folded, except that Han, hiragana and katakana characters are one
token each: those scripts put no spaces between words, and a whole sentence as one token
would make every n-gram statistic meaningless. Thai and other unspaced scripts still come out
as long runs.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlray.data.chat import accepts_chat

_CJK = (
    r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"  # Han
    r"\u3040-\u309f\u30a0-\u30ff\uff66-\uff9f"  # hiragana, katakana, half-width katakana
)
# A word: one CJK character, or a run of other word characters (see the module docstring).
_WORD = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")

_BOXED = "\\boxed"
_BRACE = re.compile(r"[{}]")
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
# Digit groups joined by commas are taken as one chain (and sorted out in _number_value)
# rather than matched as thousands here: a regex that backtracks over a long malformed chain,
# as in a truncated or degenerate completion, takes quadratic time.
_NUMBER = re.compile(
    r"""
    (?:(?<![A-Za-z0-9)\]}])(?P<sign>[-+\u2212]))?   # a sign, unless it reads as "3-2" or "x-1"
    (?P<digits>\d+(?:,\d+)*(?:\.\d+)? | \.\d+)      # 1,234.5 or 1234.5 or .5
    (?P<exponent>[eE][-+]?\d+)?
    (?:\s*/\s*(?P<denominator>\d+(?:\.\d+)?))?        # 3/4
    """,
    re.VERBOSE,
)
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")

# Characters that change what an answer means, so normalized_match never strips them: dashes
# ("-3" is not "3"), the period (".5" is not "5"; a trailing one is stripped separately) and
# a few symbols that Unicode files under punctuation.
_MEANINGFUL_PUNCTUATION = set(".%#&@/\\")

# Small default lexicons for lexicon_sentiment; a word list reads better as one string.
POSITIVE_WORDS = frozenset(
    "good great excellent amazing wonderful fantastic awesome "  # noqa: SIM905
    "superb outstanding brilliant perfect beautiful nice pleasant delightful lovely love like "
    "enjoy happy glad joy grateful thanks helpful kind best better impressive success".split()
)
NEGATIVE_WORDS = frozenset(
    "bad terrible awful horrible dreadful poor worst worse "  # noqa: SIM905
    "mediocre pathetic useless broken hate dislike regret sad unhappy angry annoying boring "
    "ugly nasty painful disappointing disappointed fail failed failure wrong problem".split()
)


@accepts_chat
def exact_match(
    prompts: list[str], completions: list[str], answer: list[Any], **_: Any
) -> list[float | None]:
    """Returns 1.0 where the completion, stripped of surrounding white space, equals the
    answer, else 0.0; None where the answer is None."""
    return _score_against(completions, answer, lambda c, a: float(c.strip() == str(a).strip()))


@accepts_chat
def normalized_match(
    prompts: list[str], completions: list[str], answer: list[Any], **_: Any
) -> list[float | None]:
    """Returns 1.0 where completion and answer are equal after NFKC, case folding, white space
    collapsing and stripping surrounding punctuation (and a trailing period), else 0.0."""
    return _score_against(
        completions, answer, lambda c, a: float(_normalize(c) == _normalize(str(a)))
    )


@accepts_chat
def numeric_match(
    prompts: list[str],
    completions: list[str],
    answer: list[Any],
    *,
    tolerance: float = 1e-6,
    relative: bool = False,
    **_: Any,
) -> list[float | None]:
    """Returns 1.0 where the completion's number (see extract_number) is within tolerance of the
    answer's, else 0.0; None where the answer is None or holds no finite number.

    The tolerance is absolute, or a fraction of |answer| when relative is true.
    """
    scores: list[float | None] = []
    for completion, raw_answer in zip(completions, answer, strict=True):
        target = None if _is_missing(raw_answer) else _answer_number(raw_answer)
        if target is None or not math.isfinite(target):
            scores.append(None)
            continue
        predicted = extract_number(completion)
        allowed = tolerance * abs(target) if relative else tolerance
        scores.append(float(predicted is not None and abs(predicted - target) <= allowed))
    return scores


def extract_number(text: str) -> float | None:
    """Returns the number in the last complete \\boxed{...} if there is one, else the last
    number in the text; None when there is none.

    Numbers may have a sign, thousands commas (1,234.5), a decimal part, an exponent (1e3),
    or be a fraction (3/4, \\frac{3}{4}). A comma is a thousands separator only before exactly
    three digits, so decimal commas (3,5) are not read as one number.
    """
    text = _LATEX_FRACTION.sub(r"\1/\2", text)
    boxed = _last_boxed(text)
    matches = list(_NUMBER.finditer(text if boxed is None else boxed))
    return _number_value(matches[-1]) if matches else None


@accepts_chat
def regex_match(
    prompts: list[str], completions: list[str], *, pattern: str, full: bool = False, **_: Any
) -> list[float | None]:
    """Returns 1.0 where the pattern matches the completion (anywhere, or all of it when full
    is true; `.` matches newlines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    matches = compiled.fullmatch if full else compiled.search
    return [float(matches(c) is not None) for c in completions]


@accepts_chat
def length_reward(
    prompts: list[str], completions: list[str], *, target: int, unit: str = "chars", **_: Any
) -> list[float | None]:
    """Returns 1 - |length - target| / target, clipped to [0, 1]: 1.0 at the target length.

    unit is "chars" (code points) or "words" (tokens as in the module docstring).
    """
    if target <= 0:
        raise ValueError(f"length_reward: target must be positive, got {target}")
    measure = _length_measure(unit)
    return [max(0.0, 1.0 - abs(measure(c) - target) / target) for c in completions]


@accepts_chat
def overlong_penalty(
    prompts: list[str],
    completions: list[str],
    *,
    max_length: int,
    soft_margin: int,
    unit: str = "chars",
    **_: Any,
) -> list[float | None]:
    """Returns 0.0 up to max_length - soft_margin, then falling linearly to -1.0 at max_length,
    and -1.0 beyond: a score in [-1, 0].

    unit is "chars" or "words"; DAPO counts model tokens, which a reward function never sees.
    """
    if not 0 <= soft_margin <= max_length:
        raise ValueError(
            f"overlong_penalty: need 0 <= soft_margin <= max_length, "
            f"got soft_margin={soft_margin}, max_length={max_length}"
        )
    measure = _length_measure(unit)
    return [_soft_overlong(measure(c), max_length, soft_margin) for c in completions]


@accepts_chat
def repetition_penalty(
    prompts: list[str], completions: list[str], *, n: int = 3, **_: Any
) -> list[float | None]:
    """Returns minus the share of word n-grams that repeat an earlier one, in [-1, 0]; 0.0 for
    a completion with fewer than n words."""
    _check_order(n)
    scores: list[float | None] = []
    for completion in completions:
        grams = _ngrams(_words(completion), n)
        scores.append(-(len(grams) - len(set(grams))) / len(grams) if grams else 0.0)
    return scores


@accepts_chat
def distinct_n(
    prompts: list[str], completions: list[str], *, n: int = 2, **_: Any
) -> list[float | None]:
    """Returns distinct word n-grams / all word n-grams, in [0, 1]; 0.0 for a completion with
    fewer than n words, so that an empty answer never scores as perfectly diverse."""
    _check_order(n)
    scores: list[float | None] = []
    for completion in completions:
        grams = _ngrams(_words(completion), n)
        scores.append(len(set(grams)) / len(grams) if grams else 0.0)
    return scores


@accepts_chat
def script_diversity(
    prompts: list[str], completions: list[str], *, mode: str = "non_ascii", **_: Any
) -> list[float | None]:
    """Returns the share of letters that are non-ASCII (mode="non_ascii") or outside the Latin
    script (mode="non_latin"), in [0, 1]; 0.0 for text with no letters.

    Accented (é), full-width (Ａ) and superscript (ⁱ) Latin letters count as Latin.
    """
    is_counted = _FOREIGN_LETTER_TESTS.get(mode)
    if is_counted is None:
        known = ", ".join(sorted(_FOREIGN_LETTER_TESTS))
        raise ValueError(f"script_diversity: unknown mode {mode!r}; known: {known}")
    scores: list[float | None] = []
    for completion in completions:
        letters = [ch for ch in completion if ch.isalpha()]
        counted = sum(1 for ch in letters if is_counted(ch))
        scores.append(counted / len(letters) if letters else 0.0)
    return scores


@accepts_chat
def lexicon_sentiment(
    prompts: list[str],
    completions: list[str],
    *,
    positive: Sequence[str] | None = None,
    negative: Sequence[str] | None = None,
    **_: Any,
) -> list[float | None]:
    """Returns (positive - negative) / (positive + negative) over lexicon word occurrences, in
    [-1, 1]; 0.0 when no lexicon word occurs.

    The lexicons default to POSITIVE_WORDS and NEGATIVE_WORDS (English); entries are single
    words, matched case-folded. Negation ("not good") is not handled.
    """
    positive_words = _folded(POSITIVE_WORDS if positive is None else positive)
    negative_words = _folded(NEGATIVE_WORDS if negative is None else negative)
    scores: list[float | None] = []
    for completion in completions:
        words = _words(completion)
        good = sum(1 for w in words if w in positive_words)
        bad = sum(1 for w in words if w in negative_words)
        scores.append((good - bad) / (good + bad) if good + bad else 0.0)
    return scores


@accepts_chat
def bleu(
    prompts: list[str],
    completions: list[str],
    reference: list[Any],
    *,
    tokenize: str = "13a",
    **_: Any,
) -> list[float | None]:
    """Returns sacrebleu's sentence BLEU against the reference(s) / 100, in [0, 1]; None where
    the reference is None.

    tokenize is sacrebleu's tokenizer name: "13a" by default, "zh" or "char" for Chinese.
    """
    # sacrebleu (and lxml) loads only in the reward process of a run that scores
    # BLEU or chrF, not in every process that imports the text rewards
    from sacrebleu.metrics import BLEU

    # sacrebleu.sentence_bleu builds a metric per sentence; one per call scores the same.
    metric = BLEU(tokenize=tokenize, effective_order=True)
    return _score_against_references(completions, reference, metric.sentence_score)


@accepts_chat
def chrf(
    prompts: list[str], completions: list[str], reference: list[Any], **_: Any
) -> list[float | None]:
    """Returns sacrebleu's sentence chrF against the reference(s) / 100, in [0, 1]; None where
    the reference is None."""
    # as in bleu
    from sacrebleu.metrics import CHRF

    metric = CHRF()
    return _score_against_references(completions, reference, metric.sentence_score)


def _is_missing(value: Any) -> bool:
    # Columns read through pandas or numpy may hold NaN where the dataset has no value.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _score_against(
    completions: list[str], answers: list[Any], score: Callable[[str, Any], float]
) -> list[float | None]:
    return [
        None if _is_missing(a) else score(c, a) for c, a in zip(completions, answers, strict=True)
    ]


def _normalize(text: str) -> str:
    # NFKC again after case folding, which can leave text unnormalized (Unicode's
    # compatibility caseless matching).
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
    return _strip_surrounding_punctuation(" ".join(folded.split()))


def _strip_surrounding_punctuation(text: str) -> str:
    start, end = 0, len(text)
    while start < end and _is_surrounding_punctuation(text[start]):
        start += 1
    while end > start and (_is_surrounding_punctuation(text[end - 1]) or text[end - 1] == "."):
        end -= 1
    return text[start:end]


def _is_surrounding_punctuation(ch: str) -> bool:
    if ch.isspace():
        return True
    category = unicodedata.category(ch)
    return category.startswith("P") and category != "Pd" and ch not in _MEANINGFUL_PUNCTUATION


def _answer_number(answer: Any) -> float | None:
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        return float(answer)
    return extract_number(str(answer))


def _last_boxed(text: str) -> str | None:
    """Returns the content of the last \\boxed{...} whose braces close, or None."""
    # One pass over the braces; searching back from each \boxed would be quadratic.
    open_braces: list[tuple[int, bool]] = []  # (content start, opens a \boxed) per open brace
    last_start, last = -1, None
    for brace in _BRACE.finditer(text):
        if brace[0] == "{":
            open_braces.append((brace.end(), text.endswith(_BOXED, 0, brace.start())))
        elif open_braces:
            start, is_boxed = open_braces.pop()
            if is_boxed and start > last_start:
                last_start, last = start, text[start : brace.start()]
    return last


def _number_value(match: re.Match[str]) -> float | None:
    digits, sign = match["digits"], match["sign"]
    if "," in digits and not _THOUSANDS.fullmatch(digits):
        # A list ("1,2,3") or a decimal comma ("3,5"): the last piece is the last number.
        digits, sign = digits.rsplit(",", 1)[1], None
    value = float(digits.replace(",", "") + (match["exponent"] or ""))
    if match["denominator"] is not None:
        denominator = float(match["denominator"])
        if denominator == 0:
            return None
        value /= denominator
    return -value if sign in ("-", "\u2212") else value


def _words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def _check_order(n: int) -> None:
    if n < 1:
        raise ValueError(f"n-gram order must be at least 1, got {n}")


_LENGTH_MEASURES: dict[str, Callable[[str], int]] = {
    "chars": len,
    "words": lambda text: len(_WORD.findall(text)),
}


def _length_measure(unit: str) -> Callable[[str], int]:
    measure = _LENGTH_MEASURES.get(unit)
    if measure is None:
        raise ValueError(f"unknown length unit {unit!r}; known: chars, words")
    return measure


def _soft_overlong(length: int, max_length: int, soft_margin: int) -> float:
    # DAPO's soft overlong punishment, https://arxiv.org/abs/2503.14476: a ramp rather than a
    # cliff at the limit, which DAPO found makes truncation a less noisy reward signal.
    if length <= max_length - soft_margin:
        return 0.0
    if length <= max_length:
        return (max_length - soft_margin - length) / soft_margin
    return -1.0


def _is_latin(ch: str) -> bool:
    # The first character of the compatibility decomposition names the base letter: é -> e,
    # Ａ -> A, ª -> a.
    base = unicodedata.normalize("NFKD", ch)[:1]
    return unicodedata.name(base, "").startswith("LATIN")


_FOREIGN_LETTER_TESTS: dict[str, Callable[[str], bool]] = {
    "non_ascii": lambda ch: not ch.isascii(),
    "non_latin": lambda ch: not _is_latin(ch),
}


def _folded(words: Iterable[str]) -> frozenset[str]:
    return frozenset(w.casefold() for w in words)


def _score_against_references(
    completions: list[str], references: list[Any], score: Callable[[str, list[str]], Any]
) -> list[float | None]:
    scores: list[float | None] = []
    for completion, reference in zip(completions, references, strict=True):
        refs = _reference_list(reference)
        # sacrebleu reports 0-100 and can overshoot 100 by a rounding error.
        scores.append(min(1.0, score(completion, refs).score / 100) if refs else None)
    return scores


def _reference_list(reference: Any) -> list[str]:
    if _is_missing(reference):
        return []
    if isinstance(reference, str):
        return [reference]
    return [r for r in reference if not _is_missing(r)]
