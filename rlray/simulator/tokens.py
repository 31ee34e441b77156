"""What the simulated engine and learner compute instead of a model: token ids from a
seed, logprobs from the policy version and the tokens, and weights whose bytes say their
version. The engine and the learner compute the same logprobs for the same version, so
a weight sync that delivered other bytes shows as a parity gap, as with a real model."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

VOCAB = 32_000
"""Token ids are drawn below this."""


def seeded(*parts: object) -> random.Random:
    """Returns a generator seeded by the parts (stable across processes, unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def prompt_token_ids(prompt: str, length: int) -> list[int]:
    """Returns a prompt's `length` token ids, the same for the same text."""
    rng = seeded("prompt", prompt)
    return [rng.randrange(VOCAB) for _ in range(length)]


def completion_token_ids(
    seed: int, prompt_index: int, sample_index: int, lengths: tuple[int, int]
) -> list[int]:
    """Returns one sample's completion: between lengths[0] and lengths[1] token ids (both
    included), the same for the same seed, prompt and sample."""
    rng = seeded("completion", seed, prompt_index, sample_index)
    return [rng.randrange(VOCAB) for _ in range(rng.randint(*lengths))]


def token_logprobs(version: int, prompt: list[int], completion: list[int]) -> list[float]:
    """Returns the logprob that the weights of `version` give each completion token, in
    (-1.05, -0.05]: a function of the version, the token, its position and the prompt's
    last token, so that two versions' logprobs of a token differ."""
    last = prompt[-1] if prompt else 0
    return [
        -0.05 - ((token * 7919 + (i + last) * 104_729 + version * 15_485_863) % 1000) / 1000
        for i, token in enumerate(completion)
    ]


PAGE_BYTES = 4096
"""A load checks one byte in each span of this many (a memory page)."""


@dataclass
class SimulatedWeights:
    """A published weights object: `size` bytes, the version as the first 8, the rest
    the version's fill byte. Loading it checks a byte of every page and the last one
    (`version_of`): an engine's load is modelled time, so the check must not cost what
    reading every byte of each engine's copy would on a machine holding many engines."""

    payload: np.ndarray

    @staticmethod
    def of(version: int, size: int) -> SimulatedWeights:
        payload = np.full(max(size, 8), fill_byte(version), dtype=np.uint8)
        payload[:8] = np.frombuffer(version.to_bytes(8, "little"), dtype=np.uint8)
        return SimulatedWeights(payload)

    def version_of(self) -> int:
        """Returns the version the bytes hold; ValueError where a checked byte (one a
        page, and the last) is not the one that version's weights have: weights of
        another version, or a transfer that wrote a page wrong or not at all."""
        version = int.from_bytes(self.payload[:8].tobytes(), "little")
        checked = np.arange(8, self.payload.size, PAGE_BYTES)
        checked = np.append(checked, self.payload.size - 1) if self.payload.size > 8 else checked
        wrong = checked[self.payload[checked] != fill_byte(version)]
        if wrong.size:
            raise ValueError(
                f"published weights of version {version}: {wrong.size} of {checked.size} "
                f"checked bytes differ from what was published (the first at byte "
                f"{int(wrong[0])})"
            )
        return version


def fill_byte(version: int) -> int:
    return version % 251
