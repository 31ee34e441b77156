"""Text reward functions against hand-worked values, in several scripts."""

import pytest

from rlray.rewards.text import (
    bleu,
    chrf,
    distinct_n,
    exact_match,
    extract_number,
    length_reward,
    lexicon_sentiment,
    normalized_match,
    numeric_match,
    overlong_penalty,
    regex_match,
    repetition_penalty,
    script_diversity,
)

ALL_REWARDS = [
    exact_match,
    normalized_match,
    numeric_match,
    regex_match,
    length_reward,
    overlong_penalty,
    repetition_penalty,
    distinct_n,
    script_diversity,
    lexicon_sentiment,
    bleu,
    chrf,
]
# Options a reward requires; the rest have defaults.
REQUIRED_OPTIONS = {
    regex_match: {"pattern": r"\d"},
    length_reward: {"target": 5},
    overlong_penalty: {"max_length": 10, "soft_margin": 2},
}


def score_one(fn, completion, **kwargs):
    """Returns fn's score for a single completion."""
    [score] = fn(["prompt"], [completion], **kwargs)
    return score


@pytest.mark.parametrize("fn", ALL_REWARDS, ids=lambda fn: fn.__name__)
def test_every_reward_ignores_unknown_kwargs_and_scores_each_completion(fn):
    completions = ["42", "Привет, мир", "猫が好き"]
    options = REQUIRED_OPTIONS.get(fn, {})
    # By keyword, as the reward loader calls them.
    scores = fn(
        prompts=["p"] * 3,
        completions=completions,
        answer=["42", "мир", None],
        reference=["42", "Привет, мир", None],
        unused_column=[1, 2, 3],
        unused_option=0.5,
        **options,
    )
    assert len(scores) == len(completions)
    assert all(s is None or isinstance(s, float) for s in scores)
    assert fn([], [], answer=[], reference=[], **options) == []


@pytest.mark.parametrize("fn", [exact_match, normalized_match, numeric_match])
def test_missing_answer_gives_none(fn):
    assert fn(["p", "p"], ["1", "1"], answer=[None, "1"]) == [None, 1.0]


@pytest.mark.parametrize("fn", [bleu, chrf])
@pytest.mark.parametrize("reference", [None, [], [None]])
def test_missing_reference_gives_none(fn, reference):
    assert score_one(fn, "some text", reference=[reference]) is None


def test_exact_match_strips_white_space_only():
    scores = exact_match(["q"] * 4, ["2", " 2 \n", "02", "Paris"], answer=[2, "2", "2", "paris"])
    assert scores == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        # "ü" and "ï" written as base letter + combining diaeresis; NFKC composes them.
        ('  "U\u0308ni\u0308code." ', "Ünïcode", 1.0),
        ("STRASSE", "Straße", 1.0),  # case folding turns ß into ss
        ("« Élève ! »", "élève", 1.0),  # French quotes and spaced "!" stripped
        ("Ｐａｒｉｓ", "Paris", 1.0),  # full-width letters, NFKC
        ("new   york\n", "New York", 1.0),
        ("北京。", "北京", 1.0),  # ideographic full stop is punctuation
        ("-3", "3", 0.0),  # a dash changes the answer, so it is kept
        (".5", "5", 0.0),  # so does a leading period
        ("3.", "3", 1.0),  # a trailing one is sentence punctuation
        ("50%", "50", 0.0),
        ("New-York", "New York", 0.0),
        ("Muenchen", "München", 0.0),  # no transliteration
    ],
)
def test_normalized_match(completion, answer, expected):
    assert score_one(normalized_match, completion, answer=[answer]) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The total is 1,234.5 dollars", 1234.5),
        ("so x = -3", -3.0),
        ("x = 3-2", 2.0),  # subtraction, not a negative number
        ("答案是-3", -3.0),  # a sign after a CJK character is still a sign
        ("about 1e3 of them", 1000.0),
        ("2.5E-3", 0.0025),
        ("3/4 of the pie", 0.75),
        ("−7", -7.0),  # U+2212 MINUS SIGN
        ("\\boxed{42}. Check: 6 * 7 = 42, not 43", 42.0),  # the box wins over later numbers
        ("\\boxed{1} first, then \\boxed{\\frac{3}{4}}", 0.75),  # the last box, LaTeX fraction
        ("\\boxed{x} then 5", None),  # a box without a number is no answer
        ("\\boxed{7 and 5", 5.0),  # an unclosed box is ignored
        ("#### 72", 72.0),  # GSM8K answer format
        ("12,345,678 people", 12345678.0),
        ("1,2345", 2345.0),  # not thousands: "1" then "2345"
        ("pick 1,2,3", 3.0),
        ("3,5 kg", 5.0),  # decimal commas are not supported: "3" then "5"
        ("٤٢", 42.0),  # Arabic-Indic digits
        ("1/0", None),
        ("no number here", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1" + ",111" * 25_000 + "1", 1111.0),
        ("\\boxed{" * 20_000, None),
        ("\\boxed{1}" + "}{" * 50_000, 1.0),
    ],
    ids=["truncated-thousands", "unclosed-boxes", "stray-braces"],
)
def test_extract_number_on_degenerate_completions(text, expected):
    # Single-pass parsing: a backtracking regex or a scan back from each \boxed took
    # minutes on these (it would show in `pytest --durations`; no timing assert here).
    assert extract_number(text) == expected


def test_numeric_match_compares_boxed_or_last_number_with_answer():
    completions = ["\\boxed{42} (not 41)", "so it is 1,234.5", "3/4", "no idea", "-3"]
    answers = ["42", 1234.5, "0.75", "7", "#### -3"]
    assert numeric_match(["q"] * 5, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_numeric_match_tolerance_is_absolute_or_relative():
    # |1001 - 1000| = 1: above an absolute 0.01, within 1% of 1000 (10).
    assert score_one(numeric_match, "1001", answer=[1000], tolerance=0.01) == 0.0
    assert score_one(numeric_match, "1001", answer=[1000], tolerance=0.01, relative=True) == 1.0
    assert score_one(numeric_match, "0.333", answer=["1/3"], tolerance=1e-3) == 1.0


def test_numeric_match_answer_without_number_is_unscorable():
    assert score_one(numeric_match, "42", answer=["forty-two"]) is None


THINK_ANSWER = r"<think>.*</think>\s*<answer>.*</answer>"


@pytest.mark.parametrize(
    ("completion", "full", "expected"),
    [
        ("<think>a\nb</think>\n<answer>4</answer>", True, 1.0),  # DOTALL: . crosses lines
        ("<think>a</think><answer>4</answer> trailing", False, 1.0),
        ("<think>a</think><answer>4</answer> trailing", True, 0.0),
        ("<answer>4</answer>", False, 0.0),
        ("<think>思考中</think> <answer>四</answer>", True, 1.0),
    ],
)
def test_regex_match_tags(completion, full, expected):
    assert score_one(regex_match, completion, pattern=THINK_ANSWER, full=full) == expected


@pytest.mark.parametrize(
    ("completion", "unit", "expected"),
    [
        ("abcde", "chars", 0.5),  # 1 - |5 - 10| / 10
        ("abcdefghij", "chars", 1.0),
        ("é" * 15, "chars", 0.5),  # code points, not bytes: 1 - 5 / 10
        ("a" * 25, "chars", 0.0),  # 1 - 15 / 10 clipped
        (" ".join(["word"] * 8) + "!", "words", 0.8),  # 1 - |8 - 10| / 10
        ("我爱你", "words", 0.3),  # a CJK character is a word: 1 - 7 / 10
    ],
)
def test_length_reward(completion, unit, expected):
    assert score_one(length_reward, completion, target=10, unit=unit) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("length", "expected"),
    [(10, 0.0), (80, 0.0), (90, -0.5), (95, -0.75), (100, -1.0), (120, -1.0)],
)
def test_overlong_penalty_ramps_down_over_the_soft_margin(length, expected):
    # Free up to 100 - 20 = 80, then (80 - length) / 20 down to -1 at 100.
    score = score_one(overlong_penalty, "x" * length, max_length=100, soft_margin=20)
    assert score == pytest.approx(expected)


def test_overlong_penalty_counts_words_and_allows_a_hard_limit():
    words = " ".join(["w"] * 11)
    assert score_one(overlong_penalty, words, max_length=10, soft_margin=0, unit="words") == -1.0
    assert score_one(overlong_penalty, "w " * 10, max_length=10, soft_margin=0, unit="words") == 0.0


@pytest.mark.parametrize(
    ("fn", "options"),
    [
        (length_reward, {"target": 0}),
        (length_reward, {"target": 5, "unit": "tokens"}),
        (overlong_penalty, {"max_length": 10, "soft_margin": 11}),
        (distinct_n, {"n": 0}),
        (script_diversity, {"mode": "non_cyrillic"}),
    ],
)
def test_bad_options_raise(fn, options):
    with pytest.raises(ValueError):
        fn(["p"], ["text"], **options)


@pytest.mark.parametrize(
    ("completion", "n", "expected"),
    [
        # Trigrams: the-cat-the, cat-the-cat, the-cat-the, cat-the-cat: 2 of 4 repeat.
        ("the cat the cat the cat", 3, -0.5),
        # Bigrams: the-cat, cat-the, the-cat, cat-the, the-cat: 3 of 5 repeat.
        ("The cat, the cat; the CAT.", 2, -0.6),
        # Characters 好好学习好好学习; trigrams 好好学 好学习 学习好 习好好 好好学 好学习: 2 of 6.
        ("好好学习，好好学习", 3, -1 / 3),
        ("all different words here", 3, 0.0),
        ("two words", 3, 0.0),  # fewer than n words
        ("", 3, 0.0),
    ],
)
def test_repetition_penalty(completion, n, expected):
    assert score_one(repetition_penalty, completion, n=n) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("completion", "n", "expected"),
    [
        ("我爱北京", 2, 1.0),  # 我爱 爱北 北京
        # 猫 が 好 き 猫 が 好 き: 7 bigrams, 4 distinct (猫が が好 好き き猫).
        ("猫が好き、猫が好き", 2, 4 / 7),
        ("Hallo hallo HALLO welt", 1, 0.5),  # case-folded: hallo x3, welt
        ("I love 東京", 2, 1.0),  # i-love, love-東, 東-京
        ("single", 2, 0.0),  # no bigram
        ("", 1, 0.0),
    ],
)
def test_distinct_n(completion, n, expected):
    assert score_one(distinct_n, completion, n=n) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("completion", "non_ascii", "non_latin"),
    [
        ("héllo", 0.2, 0.0),  # 1 of 5 letters is non-ASCII, all are Latin
        ("Привет, мир!", 1.0, 1.0),  # 9 Cyrillic letters
        ("abc αβγ", 0.5, 0.5),  # 3 Latin, 3 Greek
        ("日本語 text", 3 / 7, 3 / 7),
        ("Ａbc", 1 / 3, 0.0),  # full-width A is non-ASCII but Latin
        ("1ª vez", 0.25, 0.0),  # the ordinal indicator is a Latin letter
        ("123 !?", 0.0, 0.0),  # no letters
    ],
)
def test_script_diversity(completion, non_ascii, non_latin):
    assert score_one(script_diversity, completion) == pytest.approx(non_ascii)
    assert score_one(script_diversity, completion, mode="non_latin") == pytest.approx(non_latin)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Great movie, I LOVE it", 1.0),
        ("good start but a terrible, awful ending", -1 / 3),  # (1 - 2) / 3
        ("It rained on Tuesday", 0.0),
        ("", 0.0),
    ],
)
def test_lexicon_sentiment_default_english(completion, expected):
    assert score_one(lexicon_sentiment, completion) == pytest.approx(expected)


def test_lexicon_sentiment_custom_lexicons():
    german = {"positive": ["gut", "Lecker"], "negative": ["schlecht"]}
    # lecker, gut vs schlecht x3: (2 - 3) / 5.
    text = "Lecker und gut, aber schlecht, schlecht, SCHLECHT"
    assert score_one(lexicon_sentiment, text, **german) == pytest.approx(-0.2)
    assert score_one(lexicon_sentiment, "very good", **german) == 0.0  # defaults replaced


def test_bleu_is_one_for_identical_and_lower_for_a_paraphrase():
    reference = ["the cat sat on the mat"]
    assert score_one(bleu, "the cat sat on the mat", reference=reference) == 1.0
    # Precisions 5/6, 3/5, 1/4 and, for no 4-gram match, exp smoothing's 1/(2 * 3); no brevity
    # penalty: BLEU = (5/6 * 3/5 * 1/4 * 1/6) ** (1/4) = (1/48) ** (1/4).
    paraphrase = score_one(bleu, "the cat is on the mat", reference=reference)
    assert paraphrase == pytest.approx((1 / 48) ** 0.25)


def test_bleu_takes_the_best_of_several_references():
    references = [["a dog ran in the park", "the cat sat on the mat"]]
    assert score_one(bleu, "the cat sat on the mat", reference=references) == 1.0


def test_bleu_tokenizer_option_for_unspaced_scripts():
    # With the default tokenizer the sentence is one token and matches nothing in the
    # reference; split into characters, each of its 6 is in the reference.
    reference = ["猫が大好きです"]
    assert score_one(bleu, "猫が好きです", reference=reference) == 0.0
    assert 0.0 < score_one(bleu, "猫が好きです", reference=reference, tokenize="char") < 1.0


def test_chrf_on_non_ascii_text():
    reference = ["Grüße aus München"]
    assert score_one(chrf, "Grüße aus München", reference=reference) == 1.0
    near = score_one(chrf, "Grüße aus Munchen", reference=reference)
    far = score_one(chrf, "Grüsse aus Muenchen", reference=reference)
    assert 0.0 < far < near < 1.0
