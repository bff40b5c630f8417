"""python -m longctx.data.synthesize: seeded long-range training documents as a prepared folder,
mixable with the embedded corpus, disjoint from what the suite evaluates."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest
from helpers import CACHE_DIR

from longctx.data import ByteTokenizer, DataConfig, LongCtxDataModule, ShardSet
from longctx.data.corpus import resolve_haystack
from longctx.data.synthesize import cli, holds_only_training_haystacks, synthesize
from longctx.eval.long_documents import load_long_documents
from longctx.eval.ruler import RulerInputError

TOK = ByteTokenizer()
TASKS = "kv_recall,copy,lc_passkey,lc_niah_single"


def make(folder, seed=0, tasks=TASKS, documents=12, max_length=512, min_length=32):
    synthesize(tasks, folder, seed=seed, documents=documents, min_length=min_length,
               max_length=max_length, cache_dir=str(CACHE_DIR))  # fmt: skip
    return ShardSet(folder, "train")


def digest(docs: ShardSet) -> str:
    return hashlib.sha256(
        b"".join(docs.document(i).astype("<i8").tobytes() for i in range(docs.num_documents))
    ).hexdigest()


def test_a_prepared_folder_of_every_task_in_turn(tmp_path):
    docs = make(tmp_path / "mix")
    assert docs.num_documents == 4 * 12 and docs.manifest.splits["val"].documents == 0
    lengths = docs.document_lengths()
    assert lengths.min() >= 32 and lengths.max() <= 600
    texts = [TOK.decode(docs.document(i)) for i in range(docs.num_documents)]
    assert all(docs.document(i)[-1] == TOK.eos_id for i in range(docs.num_documents))
    kinds = ["What is the magic number for", "Copy this:", "The pass key is", "magic number for"]
    for i, text in enumerate(texts):
        assert kinds[i % 4] in text
    (source,) = docs.manifest.sources
    assert source["kind"] == "synthesize" and source["haystack"] == "embedded"
    assert holds_only_training_haystacks(tmp_path / "mix")


def test_every_question_follows_its_needle_with_its_value(tmp_path):
    docs = make(tmp_path / "kv", tasks="kv_recall", documents=20, max_length=1024)
    distances = []
    for i in range(docs.num_documents):
        text = TOK.decode(docs.document(i))
        needles = {m.group(1): (m.start(), m.group(2)) for m in re.finditer(
            r" The magic number for ([a-z]+-[a-z]+) is (\d{5})\. ", text)
            if not text[: m.start()].endswith(f"the magic number for {m.group(1)}?")}  # fmt: skip
        questions = list(re.finditer(
            r"What is the magic number for ([a-z]+-[a-z]+)\? The magic number for \1 is (\d{5})",
            text))  # fmt: skip
        assert questions and len(questions) == len(needles)
        for q in questions:
            at, value = needles[q.group(1)]
            assert at < q.start() and value == q.group(2)
            distances.append((q.start() - at) / len(text))
    assert max(distances) > 0.5  # retrieval distances reach across the document


def test_the_same_seed_gives_the_same_documents(tmp_path):
    first = digest(make(tmp_path / "a", seed=3))
    assert first == digest(make(tmp_path / "b", seed=3))
    assert first != digest(make(tmp_path / "c", seed=4))


def test_haystacks_come_from_the_training_chapters_not_the_held_out_books(tmp_path):
    docs = make(tmp_path / "mix", tasks="lc_passkey", documents=10, min_length=256)
    train = " ".join(resolve_haystack("embedded", str(CACHE_DIR)).text().sentences)
    books = " ".join(resolve_haystack("books", str(CACHE_DIR)).text().sentences)
    for i in range(docs.num_documents):
        text = TOK.decode(docs.document(i))
        piece = max(re.split(r" The pass key is \d+\. Remember it\. | What is the pass key\?", text),
                    key=len)[:48]  # fmt: skip
        assert len(piece) == 48 and piece in train and piece not in books


def test_the_mix_trains_beside_the_embedded_corpus(tmp_path):
    make(tmp_path / "mix", documents=40, max_length=256)
    # weights are per document: a chapter is ~3,600 tokens, a synthesized document ~150
    config = DataConfig(shards=["embedded", str(tmp_path / "mix")], weights=[0.02, 0.98],
                        seq_len=256, micro_batch_size=2, val_rows=2, cache_dir=str(CACHE_DIR))  # fmt: skip
    datamodule = LongCtxDataModule(config, rank=0, world_size=1)
    datamodule.setup("fit")
    assert datamodule.folders()[0].name == "kjv-chapters-v2"
    rows = [b for _, b in zip(range(8), datamodule.train_dataloader(), strict=False)]
    text = "".join(TOK.decode(b.tokens.flatten()) for b in rows)
    assert "Copy this:" in text or "magic number" in text or "pass key" in text
    # the held-out books are still unseen by such a mix: they stay its long documents
    assert len(load_long_documents(config)) == 6
    (tmp_path / "other.txt").write_text("some other corpus. " * 50)
    from longctx.data.prepare import prepare

    prepare([tmp_path / "other.txt"], tmp_path / "other", val_fraction=0.0, progress=False)
    other = DataConfig(shards=["embedded", str(tmp_path / "other")], cache_dir=str(CACHE_DIR))
    with pytest.raises(ValueError, match="data.long_documents is not set"):
        load_long_documents(other)


def test_bad_input_is_refused(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        cli(["--tasks", "copy", "--out", str(tmp_path / "full")])
    assert exit_.value.code == 2
    assert "error: --out is not a new or empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["notes.txt"]
    with pytest.raises(SystemExit):
        cli(["--tasks", "copy,bogus", "--out", str(tmp_path / "new")])
    assert "error: unknown task ('bogus')" in capsys.readouterr().err
    with pytest.raises(RulerInputError, match=r"max_length=16; expected an int >= min_length=32"):
        synthesize("copy", tmp_path / "x", min_length=32, max_length=16)
    with pytest.raises(RulerInputError, match=r"lc_niah_multikey does not fit --max-length 128"):
        synthesize("lc_niah_multikey", tmp_path / "y", max_length=128, cache_dir=str(CACHE_DIR))
    assert not np.any([p.exists() for p in (tmp_path / "new", tmp_path / "x")])


def test_repeat_documents_are_a_span_twice(tmp_path):
    docs = make(tmp_path / "rep", tasks="repeat", documents=8, max_length=256)
    for i in range(docs.num_documents):
        first, second = TOK.decode(docs.document(i)).split("\n")[:2]
        assert first == second and re.fullmatch(r"[a-z]{4,}", first)
