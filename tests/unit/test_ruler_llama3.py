"""The effective-length suite under Llama 3's BPE: every task's instances (whatever SUITE_TASKS
holds: RULER's 13 and longctx's own) have exact lengths under `llama3`, hold no special id, and
the answer's tokens are the needle's, each piece encoded on its own as the prompt holds it."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from helpers import CACHE_DIR

from longctx.data.tokenizer import load_tokenizer
from longctx.eval.ruler import make_instances
from longctx.synthetic.tasks import SUITE_TASKS

QA = Path(__file__).resolve().parents[1] / "fixtures" / "ruler_qa"
LENGTHS = [1024, 2048]
# the small qa fixture (tests/fixtures/ruler_qa): under Llama 3's ids its hotpotqa documents
# fill 512..544 tokens (shorter: a question's gold documents do not fit; longer: it runs out)
QA_LENGTHS = [512, 544]
# tasks whose references are needles written into the prompt as " value" (vt: "value")
NEEDLE_TASKS = [t for t in SUITE_TASKS if t.startswith(("niah", "vt", "fwe"))]


@functools.cache
def instances(task: str):
    tok = load_tokenizer("llama3")
    lengths = QA_LENGTHS if task.startswith("qa") else LENGTHS
    return make_instances(tok, [task], lengths, [0.0, 0.5, 1.0], 1, haystack="books",
                          cache_dir=str(CACHE_DIR), qa_data=QA)  # fmt: skip


@pytest.mark.parametrize("task", SUITE_TASKS)
def test_every_instance_has_its_exact_length_under_llama3(task):
    made = instances(task)
    assert {i.length for i in made} == set(QA_LENGTHS if task.startswith("qa") else LENGTHS)
    for i in made:
        room = max(i.tokens_to_generate, i.answer_len)  # the generation fits the length too
        assert len(i.prompt) + room == i.length, (task, i.length, len(i.prompt), room)
        assert len(i.tokens) == len(i.prompt) + i.answer_len <= i.length
        assert i.tokens.dtype == np.int64 and i.tokens.max() < 128000  # text ids, no specials
        assert np.array_equal(i.labels()[-i.answer_len :], i.tokens[-i.answer_len :])


@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_the_answer_tokens_are_the_needles_under_llama3(task):
    tok = load_tokenizer("llama3")
    for i in instances(task):
        prompt, answer = list(i.prompt), list(i.tokens[-i.answer_len :])
        assert tok.decode(answer).strip() == i.answer
        for ref in i.references:
            piece = list(tok.encode(ref if task.startswith("vt") else f" {ref}"))
            assert _contains(prompt, piece), (task, ref)  # the needle, as the prompt holds it
            assert _contains(answer, piece), (task, ref)  # and the answer repeats its tokens


def _contains(seq: list, piece: list) -> bool:
    return any(seq[k : k + len(piece)] == piece for k in range(len(seq) - len(piece) + 1))
