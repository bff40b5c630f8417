"""Long held-out documents: kept out of training, scored per position out to 4x the length."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import CACHE_DIR

from longctx.data import DataConfig, ShardSet
from longctx.data.corpus import (
    HELD_OUT_BOOKS,
    books,
    chapters,
    default_corpus_dir,
    kjv_source_path,
    long_documents_dir,
)
from longctx.eval.callbacks import LongDocumentLoss, PositionLossCurves
from longctx.eval.files import write_json
from longctx.eval.long_documents import (
    check_eval_length,
    load_long_documents,
    octave_metrics,
    octave_starts,
    octave_table,
    probe_lengths,
    score_long_documents,
)


def test_held_out_books_are_in_no_training_document():
    train = ShardSet(default_corpus_dir(CACHE_DIR), "train")
    text = b"".join(train.document(i)[:-1].astype(np.uint8).tobytes() for i in range(len(train)))
    held_out = [c for c in chapters(kjv_source_path()) if c["id"].split("/")[1] in HELD_OUT_BOOKS]
    assert len(held_out) == 74  # every chapter of the six books
    for chapter in held_out:
        body = chapter["text"].split("\n\n", 1)[1].encode()  # without the "Book N" heading
        assert text.find(body) == -1, f"{chapter['id']} is in the training split"
    # and the training split still holds the rest: a chapter of a kept book is found
    kept = next(c for c in chapters(kjv_source_path()) if c["id"] == "kjv/Genesis/2")
    assert text.find(kept["text"].split("\n\n", 1)[1].encode()) != -1


def test_long_documents_are_the_whole_books_in_order():
    docs = load_long_documents(DataConfig(cache_dir=str(CACHE_DIR)))
    expected = list(books(kjv_source_path(), HELD_OUT_BOOKS))
    assert [d.size for d in docs] == [len(b["text"].encode()) + 1 for b in expected]  # + EOS
    assert min(d.size for d in docs) > 4 * 4096  # 4x a 4096 training length, every book
    romans = bytes(docs[HELD_OUT_BOOKS.index("Romans")][:-1].astype(np.uint8))
    assert romans.startswith(b"Romans 1\n\n1 Paul") and b"Romans 16\n\n" in romans


def test_a_user_corpus_needs_its_own_long_documents(tmp_path):
    config = DataConfig(shards=[str(tmp_path)], cache_dir=str(CACHE_DIR))
    with pytest.raises(ValueError, match=r"data.long_documents is not set and data.shards="):
        load_long_documents(config)
    folder = long_documents_dir(CACHE_DIR)
    config = DataConfig(shards=[str(tmp_path)], long_documents=str(folder))
    assert len(load_long_documents(config)) == len(HELD_OUT_BOOKS)


class PositionLossModel(torch.nn.Module):
    """token_loss = the in-document position: every octave's mean is known by hand."""

    def token_loss(self, batch):
        return batch.position_ids.float()


def test_octaves_match_hand_computation():
    assert octave_starts(64, 4) == [0, 32, 64, 128]
    docs = [np.arange(1, 301), np.arange(1, 101)]  # 300 and 100 tokens
    scored = score_long_documents(PositionLossModel(), docs, 64, 4, 256, 0, "cpu")
    table = octave_table(scored["octaves"], 64, 4)
    # doc 0 is cut at 256 tokens: positions 0..254 have targets; doc 1: positions 0..98
    mean = lambda a, b: float(np.mean(np.arange(a, b)))  # noqa: E731
    assert [(r["multiple"], r["start"], r["end"]) for r in table] == [
        (1, 32, 64),
        (2, 64, 128),
        (4, 128, 256),
    ]
    assert table[0]["loss"] == pytest.approx(mean(32, 64)) and table[0]["tokens"] == 64
    both = (mean(64, 128) * 64 + mean(64, 99) * 35) / 99
    assert table[1]["loss"] == pytest.approx(both) and table[1]["tokens"] == 99
    assert table[2]["loss"] == pytest.approx(mean(128, 255)) and table[2]["tokens"] == 127
    assert octave_metrics(table) == {
        "val/long_loss/1x": table[0]["loss"],
        "val/long_loss/2x": table[1]["loss"],
        "val/long_loss/4x": table[2]["loss"],
    }
    curve_tokens = sum(r["tokens"] for r in scored["curve"])
    assert curve_tokens == 255 + 99  # the log2 curve covers every scored position


def test_probe_lengths_reach_the_factor():
    assert probe_lengths(2048, 4) == [1024, 2048, 4096, 8192]
    assert probe_lengths(512, 2) == [512, 1024]


def test_evaluation_lengths_beyond_rope_are_refused():
    with pytest.raises(ValueError, match=r"evaluation length 8192 \(4 x seq_len=2048\) exceeds "
                       r"model.max_seq_len=4096, the largest position RoPE is configured for"):  # fmt: skip
        score_long_documents(PositionLossModel(), [np.arange(10)], 2048, 4, 4096, 0, "cpu")
    check_eval_length(4096, 4096, "exactly the limit")  # allowed
    for factor in (0, 3, 2.0):
        with pytest.raises(ValueError, match=rf"factor={factor!r}; expected"):
            octave_starts(64, factor)


def fake_fit(seq_len: int, max_seq_len: int):
    datamodule = SimpleNamespace(config=DataConfig(seq_len=seq_len, cache_dir=str(CACHE_DIR)))
    trainer = SimpleNamespace(datamodule=datamodule)
    module = SimpleNamespace(model_config=SimpleNamespace(max_seq_len=max_seq_len))
    return trainer, module


def test_callbacks_refuse_lengths_beyond_rope_at_setup():
    trainer, module = fake_fit(seq_len=1024, max_seq_len=2048)
    with pytest.raises(ValueError, match=r"evaluation length 4096 \(LongDocumentLoss factor=4 "
                       r"x data.seq_len=1024\) exceeds model.max_seq_len=2048"):  # fmt: skip
        LongDocumentLoss(factor=4).setup(trainer, module, "fit")
    LongDocumentLoss(factor=2).setup(trainer, module, "fit")
    with pytest.raises(ValueError, match=r"evaluation length 4096 \(passkey probe length\)"):
        PositionLossCurves(probe_factor=4).setup(trainer, module, "fit")
    with pytest.raises(ValueError, match=r"factor=3; expected a power of two"):
        LongDocumentLoss(factor=3)


def test_eval_json_is_standard_for_an_empty_octave(tmp_path):
    table = octave_table([], 64, 2)
    assert [r["tokens"] for r in table] == [0, 0] and octave_metrics(table) == {}
    path = tmp_path / "eval.json"
    write_json(table, path)
    assert "NaN" not in path.read_text() and json.loads(path.read_text())  # standard JSON
