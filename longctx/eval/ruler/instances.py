"""One evaluation instance: the prompt, the expected answer after it, and what it was made of.

An instance of length ``L`` has a prompt of exactly ``L - max(tokens_to_generate, answer_len)``
tokens (RULER's budget: the prompt and the generation fit L; so does the teacher-forced answer,
which is longer than the generation only for cwe under a byte tokenizer), then the answer's
``answer_len`` tokens.
Generation reads ``prompt``; the teacher-forced mode reads ``tokens[:-1]`` and scores the
argmax at every answer token (``labels()``), a stricter lower bound on RULER's score.
An instance is a pure function of (task, length, depth, seed, sample, tokenizer, haystack,
qa data): its random choices come from ``random.Random`` seeded with a string, which gives the
same stream on every machine and Python version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.batch import IGNORE_INDEX
from longctx.io import atomic_write_text
from longctx.synthetic import TaskInputError

# bad input to the suite (a task, length, depth, haystack or data folder): one line
RulerInputError = TaskInputError


@dataclasses.dataclass(frozen=True)
class Instance:
    """``tokens``: the prompt, then the expected answer (its last ``answer_len`` tokens).

    ``answer``: the answer as text (RULER's references as an answer naturally writes them);
    ``references``: RULER's outputs list, scored by ``metric`` ("string_match_all" or
    "string_match_part") on a generation of ``tokens_to_generate`` tokens. ``reference``: the
    (start, stop) token span of the first occurrence of what the answer repeats (lc_copy scores
    the repeat against it), and ``distance`` the tokens between the two starts. The question
    (and answer prefix) is the ``question_len`` tokens before the answer.
    """

    task: str
    length: int
    depth: float
    sample: int
    seed: int
    tokens: np.ndarray
    answer: str
    answer_len: int
    reference: tuple[int, int] | None = None
    distance: int | None = None
    question_len: int = 0
    references: tuple[str, ...] = ()
    metric: str = "string_match_all"
    tokens_to_generate: int = 0

    @property
    def prompt(self) -> np.ndarray:
        """int64 [length - max(tokens_to_generate, answer_len)]: everything the model reads
        before generating (template, context, question and answer prefix)."""
        return self.tokens[: len(self.tokens) - self.answer_len]

    def labels(self) -> np.ndarray:
        """int64 [len(tokens) - 1]: the answer (and reference) tokens at the positions that
        predict them, for the teacher-forced inputs ``tokens[:-1]``."""
        labels = np.full(len(self.tokens) - 1, IGNORE_INDEX, dtype=np.int64)
        labels[-self.answer_len :] = self.tokens[-self.answer_len :]
        if self.reference is not None:
            start, stop = self.reference
            labels[start - 1 : stop - 1] = self.tokens[start:stop]
        return labels

    @property
    def reference_len(self) -> int:
        return 0 if self.reference is None else self.reference[1] - self.reference[0]


def instance_record(instance: Instance, tokenizer) -> dict:
    """One JSONL row: what the model reads, the answer, and a digest of the token ids."""
    answer = instance.tokens[-instance.answer_len :]
    question_start = len(instance.tokens) - instance.answer_len - instance.question_len
    return {
        "task": instance.task,
        "length": instance.length,
        "depth": instance.depth,
        "sample": instance.sample,
        "seed": instance.seed,
        "answer": instance.answer,
        "references": list(instance.references),
        "metric": instance.metric,
        "tokens_to_generate": instance.tokens_to_generate,
        "answer_text": tokenizer.decode(answer),
        "answer_tokens": [int(t) for t in answer],
        "context": tokenizer.decode(instance.tokens[:question_start]),
        "question": tokenizer.decode(instance.tokens[question_start : -instance.answer_len]),
        "distance": instance.distance,
        "tokens_sha256": tokens_digest([instance]),
    }


def write_instances(instances: Sequence[Instance], tokenizer, path: str | Path) -> Path:
    """Every instance as one JSON line (its text, answer and token digest)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (
        json.dumps(instance_record(i, tokenizer), ensure_ascii=False) + "\n" for i in instances
    )
    atomic_write_text(path, "".join(lines))
    return path


def tokens_digest(instances: Sequence[Instance]) -> str:
    """sha256 of the instances' token ids (int64 little endian): equal on every machine."""
    digest = hashlib.sha256()
    for instance in instances:
        digest.update(np.asarray(instance.tokens, dtype="<i8").tobytes())
    return digest.hexdigest()
