"""The verifiable task the RL steps train on: small additions with a rule-based reward.

Prompts are generated deterministically from (seed, step). Text goes through the
checkpoint's tokenizer when it ships one, else through bytes (token id = byte value), which
is what the tiny test checkpoints and the fidelity lab's byte-level model use."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from moe_proxy.errors import InvalidReproConfig

TASKS = ("arithmetic",)

# Reward = FORMAT_WEIGHT * (share of digits in the answer) + (1 - FORMAT_WEIGHT) * (share of
# the target's digits right in place), and exactly 1.0 for the exact answer. The format part
# gives an untrained model a graded signal, so group advantages are not all zero.
FORMAT_WEIGHT = 0.2


@dataclass
class Prompt:
    text: str
    answer: str


class Codec:
    """Text <-> token ids. Byte mode: id = byte value, newline ends an answer."""

    def __init__(self, checkpoint_dir: Path, vocab_size: int):
        self.tokenizer = None
        # Only a real vocabulary counts (side files alone, as the tiny checkpoints carry, do not).
        if any((checkpoint_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
        elif vocab_size < 256:
            raise InvalidReproConfig(
                f"the checkpoint has no tokenizer and a vocabulary of {vocab_size} < 256 tokens, "
                "too small for byte-level prompts")

    @property
    def eos_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        return ord("\n")

    @property
    def pad_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        return self.eos_id if self.tokenizer is not None else 0

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return bytes(i % 256 for i in ids).decode("latin-1")


def make_prompts(task: str, seed: int, step: int, count: int) -> list[Prompt]:
    if task not in TASKS:
        raise InvalidReproConfig(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(f"{seed}:{step}")
    prompts = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        prompts.append(Prompt(text=f"{a}+{b}=", answer=str(a + b)))
    return prompts


def reward(response: str, answer: str) -> float:
    """Rule-based score in [0, 1] of one response (text before the first newline)."""
    text = response.split("\n", 1)[0].strip()
    if text == answer:
        return 1.0
    if not text:
        return 0.0
    digits = sum(c.isdigit() for c in text) / len(text)
    in_place = sum(1 for i, c in enumerate(answer) if i < len(text) and text[i] == c) / len(answer)
    return FORMAT_WEIGHT * digits + (1 - FORMAT_WEIGHT) * in_place * min(1.0, len(answer) / len(text))
