"""The out-of-distribution long-range mix (longctx.synthetic.ood): no template, key word or value
format shared with the suite's tasks, checked on generated text; answer masks; the synthesizer."""

from __future__ import annotations

import random
import re
from itertools import repeat

import numpy as np
import pytest

from longctx.data.synthesize import synthesize
from longctx.data.tokenizer import load_tokenizer
from longctx.synthetic import ood as ood_tasks
from longctx.synthetic.pieces import Encoder
from longctx.synthetic.tasks import SUITE_TASKS, TASKS, lay_out, names_of

OOD_TASKS = names_of("ood")

TOKENIZER = load_tokenizer("byte")
# the suite's value formats (RULER: 7-digit numbers and uuids; longctx's own tasks: 5 digits)
SUITE_VALUES = (r"(?<![0-9])[0-9]{5}(?![0-9])", r"(?<![0-9])[0-9]{7}(?![0-9])",
                r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")  # fmt: skip


def enc(text: str) -> np.ndarray:
    return np.asarray(TOKENIZER.encode(text), dtype=np.int64)


def ood_document(name: str, index: int, length: int = 1024) -> tuple[str, np.ndarray, np.ndarray]:
    """A document on a blank haystack (spaces), so its text is the task's own."""
    rng = random.Random(f"test/{name}/{index}")
    build = TASKS[name].build
    tokens, mask = ood_tasks.document(build, rng, Encoder(TOKENIZER), length, repeat(enc(" ")))
    return TOKENIZER.decode(tokens), tokens, mask


@pytest.fixture(scope="module")
def ood_texts() -> dict[str, list[str]]:
    return {name: [ood_document(name, i)[0] for i in range(20)] for name in OOD_TASKS}


@pytest.fixture(scope="module")
def suite_texts() -> list[str]:
    """Every suite task but the QA ones (RULER's 13 and the lc_* formats, on the noise
    haystack), three instances each: prompt and answer."""
    from longctx.synthetic import DoesNotFit, NoiseHaystack

    texts = []
    for name in SUITE_TASKS:
        task = TASKS[name]
        if task.reads == "qa":
            continue  # questions about a --qa-data folder's documents: no key or value format
        haystack = NoiseHaystack() if task.reads == "haystack" else None
        for sample in range(3):
            rng = random.Random(f"test/suite/{name}/{sample}")
            for length in (1024, 4096, 16384):  # the shortest it fits (cwe needs more bytes)
                try:
                    layout, laid = lay_out(task, Encoder(TOKENIZER), length, 0.5, rng, haystack)
                    break
                except DoesNotFit:
                    continue
            texts.append(TOKENIZER.decode(np.concatenate([laid.prompt, layout.answer])))
    assert len(texts) >= 3 * 13
    return texts


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def trigrams(text: str) -> set[tuple[str, ...]]:
    """Word trigrams (words of 3 letters or more: not the letters of hex values and uuids)."""
    w = [x for x in words(text) if len(x) >= 3]
    return set(zip(w, w[1:], w[2:], strict=False))


def template_regex(template: str) -> str:
    parts = re.split(r"\{\w+\}", template)
    return r"\S+".join(re.escape(p) for p in parts)


def test_no_template_is_shared(ood_texts, suite_texts):
    for name, templates in ood_tasks.TEMPLATES.items():
        for template in templates:
            pattern = template_regex(template)
            assert any(re.search(pattern, t) for t in ood_texts[name]), (name, template)
            assert not any(re.search(pattern, t) for t in suite_texts), (name, template)
    ours = set().union(*(trigrams(t) for texts in ood_texts.values() for t in texts))
    theirs = set().union(*(trigrams(t) for t in suite_texts))
    assert not ours & theirs, sorted(ours & theirs)[:5]


def test_no_key_word_is_shared(ood_texts, suite_texts):
    from longctx.synthetic import lc_formats
    from longctx.synthetic.words import common_words

    vocabulary = {w for t in suite_texts for w in words(t)}
    # every list the suite draws keys and words from (RULER's wonderwords lists, lc_*'s words)
    vocabulary |= {w for item in (*common_words(), *lc_formats.WORDS) for w in words(item)}
    assert {"special", "magic", "quiet", "river"} <= vocabulary and len(vocabulary) > 1000
    for name, texts in ood_texts.items():
        ours = {w for t in texts for w in words(t)}
        keys = {w for w in ours if w.endswith("q")}
        assert len(keys) >= 20, name  # the codes are there, and none is the suite's
        assert not keys & vocabulary, (name, sorted(keys & vocabulary)[:5])


def test_no_value_format_is_shared(ood_texts, suite_texts):
    for name, pattern in ood_tasks.VALUE_FORMATS.items():
        assert all(re.search(pattern, t) for t in ood_texts[name]), name
        assert not any(re.search(pattern, t) for t in suite_texts), (name, pattern)
    for pattern in SUITE_VALUES:
        assert not any(re.search(pattern, t) for texts in ood_texts.values() for t in texts)


@pytest.mark.parametrize("name", sorted(OOD_TASKS))
def test_answer_tokens_are_values_stated_earlier(name):
    text, tokens, mask = ood_document(name, 0, length=600)
    assert mask.any() and len(tokens) == len(mask)
    starts = np.flatnonzero(mask & ~np.r_[False, mask[:-1]])
    for start in starts:
        stop = start + np.argmin(mask[start:]) if not mask[start:].all() else len(mask)
        answer = TOKENIZER.decode(tokens[start:stop])
        value = ("#" if name == "ood_ledger" else "") + answer.strip()  # '#' is the template's
        assert re.fullmatch(ood_tasks.VALUE_FORMATS[name], value), answer
        before = TOKENIZER.decode(tokens[:start])
        assert answer.strip() in before  # retrievable: stated before it is asked
    assert len(starts) >= 600 // ood_tasks.EVERY[name]


def test_documents_are_about_the_length_asked():
    for name in OOD_TASKS:
        assert abs(len(ood_document(name, 1, 2048)[1]) - 2048) <= 2048 // 10


def test_synthesized_ood_folder_is_deterministic(tmp_path):
    from longctx.data.shards import ShardSet

    kwargs = dict(seed=3, documents=3, min_length=128, max_length=512, haystack="noise")
    synthesize(",".join(OOD_TASKS), tmp_path / "a", **kwargs)
    synthesize(",".join(OOD_TASKS), tmp_path / "b", **kwargs)
    a, b = ShardSet(tmp_path / "a", "train"), ShardSet(tmp_path / "b", "train")
    assert a.num_documents == 3 * len(OOD_TASKS)
    for i in range(a.num_documents):
        assert np.array_equal(a.document(i), b.document(i))
        assert len(a.document(i)) <= 512
    texts = [TOKENIZER.decode(a.document(i)[:-1]) for i in range(4)]
    assert "Entry " in texts[0] and "'s locker holds" in texts[1] and "Trail from" in texts[2]
