"""The verifiable task the RL steps train on: small additions with a rule-based reward, or
the failing run's own prompts (`--prompts`: verl's RL data, scored by exact match).

Prompts are generated deterministically from (seed, step). Text goes through the
checkpoint's tokenizer when it ships one, else through bytes (token id = byte value), which
is what the tiny test checkpoints and the fidelity lab's byte-level model use."""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

from moe_proxy.errors import InvalidReproConfig

# "arithmetic": two-digit sums scored by `reward`. "small-sums": one-digit sums scored by how near
# the answer's number is to the sum (distance_reward): a small model that answers two-digit sums
# with any two digits climbs it in tens of RL steps by learning to answer small numbers (the
# fidelity lab's learning task), where two-digit sums' reward stays flat.
TASKS = ("arithmetic", "small-sums")
SMALL_SUMS_SCALE = 10  # distance_reward's scale: an answer 10 or more away from the sum scores 0

# Reward = FORMAT_WEIGHT * (share of digits in the answer) + (1 - FORMAT_WEIGHT) * (share of
# the target's digits right in place), and exactly 1.0 for the exact answer. The format part
# gives an untrained model a graded signal, so group advantages are not all zero.
FORMAT_WEIGHT = 0.2


@dataclass
class Prompt:
    text: str
    answer: str
    messages: list[dict] | None = None  # a chat prompt (verl data), rendered by the codec
    exact: bool = False  # scored by exact match against `answer` (verl data) instead of `reward`
    distance: bool = False  # scored by distance_reward instead of `reward`

    def score(self, response: str) -> float:
        if self.exact:
            return float(response.strip() == self.answer.strip())
        return distance_reward(response, self.answer) if self.distance else reward(response, self.answer)


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

    def render(self, prompt: Prompt) -> str:
        """A prompt's text: a chat prompt through the tokenizer's chat template when it has one,
        else its messages' contents, one per line."""
        if prompt.messages is None:
            return prompt.text
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        return prompt.text

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return bytes(i % 256 for i in ids).decode("latin-1")


def make_prompts(task: str, seed: int, step: int, count: int, dataset: PromptSet | None = None) -> list[Prompt]:
    if dataset is not None:
        return dataset.batch(step, count)
    if task not in TASKS:
        raise InvalidReproConfig(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(f"{seed}:{step}")
    top = 10 if task == "small-sums" else 100
    prompts = []
    for _ in range(count):
        a, b = rng.randrange(top), rng.randrange(top)
        prompts.append(Prompt(text=f"{a}+{b}=", answer=str(a + b), distance=task == "small-sums"))
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


def distance_reward(response: str, answer: str) -> float:
    """1 - |number - sum| / SMALL_SUMS_SCALE, at least 0, for an answer of digits only (text before
    the first newline); 0 for anything else."""
    text = response.split("\n", 1)[0].strip()
    if not text.isascii() or not text.isdigit():
        return 0.0
    return max(0.0, 1.0 - abs(int(text) - int(answer)) / SMALL_SUMS_SCALE)


class PromptSet:
    """Prompts from a file (verl's RL data). Each epoch walks a permutation drawn from (seed,
    epoch), as a shuffling data loader does; step s takes the next `count` rows."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self._order: dict[int, list[int]] = {}

    def batch(self, step: int, count: int) -> list[Prompt]:
        n = len(self.prompts)
        out = []
        for i in range(step * count, (step + 1) * count):
            epoch, pos = divmod(i, n)
            if epoch not in self._order:
                order = list(range(n))
                random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
                self._order = {epoch: order}  # one epoch at a time is all a run needs
            out.append(self.prompts[self._order[epoch][pos]])
        return out


def load_prompts(uri: str) -> list[Prompt]:
    """verl's RL data from a local file or s3://bucket/key: parquet or JSON lines, each row with
    a chat `prompt` (a list of {role, content}, or a plain string) and
    `reward_model.ground_truth`."""
    data = _read(uri)
    if data[:4] == b"PAR1" or uri.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InvalidReproConfig(f"--prompts {uri}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            rows = pq.read_table(io.BytesIO(data)).to_pylist()
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types
            raise InvalidReproConfig(f"--prompts {uri}: not a readable parquet file ({exc})") from None
    else:
        rows = []
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidReproConfig(f"--prompts {uri}:{number}: not JSON ({exc.msg}); expected parquet or "
                                         "JSON lines") from None
    if not rows:
        raise InvalidReproConfig(f"--prompts {uri}: no rows")
    return [_prompt(row, f"{uri} row {i}") for i, row in enumerate(rows)]


def _read(uri: str) -> bytes:
    if uri.startswith("s3://"):
        from moe_proxy.storage import open_store

        prefix, _, name = uri.rpartition("/")
        return open_store(prefix).read_bytes(name)
    path = Path(uri)
    if not path.is_file():
        raise InvalidReproConfig(f"--prompts {uri}: no such file")
    return path.read_bytes()


def _prompt(row, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise InvalidReproConfig(f"--prompts {where}: a row must be an object, got {type(row).__name__}")
    if "prompt" not in row or row["prompt"] is None:
        raise InvalidReproConfig(f"--prompts {where}: missing field `prompt` (verl's chat prompt, a list of "
                                 "{role, content})")
    truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    if truth is None:
        raise InvalidReproConfig(f"--prompts {where}: missing field `reward_model.ground_truth`")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt) and prompt:
        messages = [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in prompt]
    else:
        raise InvalidReproConfig(f"--prompts {where}: `prompt` must be a list of {{role, content}} messages")
    answer = truth if isinstance(truth, str) else json.dumps(truth) if isinstance(truth, (list, dict)) else str(truth)
    return Prompt(text="\n".join(m["content"] for m in messages), answer=answer, messages=messages, exact=True)
