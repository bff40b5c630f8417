"""Packing on Llama 3's ids: every document is ``<|begin_of_text|> text <|end_of_text|>`` (BOS
by default for llama3, data.add_bos), each token appears once and in order, no label crosses a
document, and the rows' segments are exactly the EOS-derived boundaries of Megatron's
reset-at-EOD (``PackedBatch.from_eos`` on the concatenated stream). The same checks run on the
byte tokenizer, whose documents get no BOS by default."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data import LongCtxDataModule
from longctx.data.config import DataConfig
from longctx.data.corpus import chapters, kjv_source_path
from longctx.data.packing import collate_rows, make_packer
from longctx.data.tokenizer import load_tokenizer, packing_bos_id

TOKENIZERS = ["llama3", "byte"]
SEQ_LEN = 512  # short rows: documents are split across rows too


@functools.cache
def documents(name: str) -> tuple[np.ndarray, ...]:
    """Forty chapters as prepare stores them: the text's ids, then EOS."""
    tok = load_tokenizer(name)
    texts = [r["text"] for r in itertools.islice(chapters(kjv_source_path()), 40)]
    return tuple(np.append(tok.encode(t), tok.eos_id).astype(np.uint32) for t in texts)


def bos_for(name: str, add_bos: bool | None) -> int | None:
    return packing_bos_id(add_bos, load_tokenizer(name).spec)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_default_bos_is_the_tokenizers_convention(name):
    assert bos_for(name, None) == (128000 if name == "llama3" else None)
    assert bos_for(name, False) is None
    assert bos_for(name, True) == load_tokenizer(name).bos_id


@pytest.mark.parametrize("add_bos", [None, False])
@pytest.mark.parametrize("packer", ["concat_chunk", "best_fit"])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_every_document_once_in_order_between_bos_and_eos(name, packer, add_bos):
    tok, docs = load_tokenizer(name), documents(name)
    bos = bos_for(name, add_bos)
    rows = list(make_packer(packer, SEQ_LEN, pad_id=tok.pad_id, buffer_size=8, bos_id=bos)
                .pack(docs))  # fmt: skip
    expected = [doc if bos is None else np.concatenate(([bos], doc)) for doc in docs]
    pieces: list[dict[int, np.ndarray]] = [{} for _ in docs]  # offset -> piece, per document
    for row in rows:
        start = 0
        for length in row.seq_lens[: row.documents]:
            segment = row.tokens[start : start + length]
            labels = row.labels[start : start + length]
            i, offset = _find_piece(expected, pieces, segment)
            pieces[i][offset] = segment
            assert np.array_equal(labels[:-1], segment[1:])  # labels stay in the document
            if offset + length == len(expected[i]):  # its end: the EOS predicts nothing
                assert segment[-1] == tok.eos_id and labels[-1] == IGNORE_INDEX
            start += length
        assert (row.labels[start:] == IGNORE_INDEX).all()  # the pad tail
    for doc, parts in zip(expected, pieces, strict=True):
        assert np.array_equal(np.concatenate([parts[o] for o in sorted(parts)]), doc)  # once


def _find_piece(expected, pieces, segment) -> tuple[int, int]:
    """(document, offset) of a not yet seen piece equal to ``segment``: the document's next
    token on (concat_chunk), or an offset that is a multiple of L (best_fit's splits; its rows
    leave a buffer in shuffled order)."""
    for i, doc in enumerate(expected):
        next_offset = max((o + len(p) for o, p in pieces[i].items()), default=0)
        for offset in {next_offset, *range(0, len(doc), SEQ_LEN)} - set(pieces[i]):
            if np.array_equal(doc[offset : offset + len(segment)], segment):
                return i, offset
    raise AssertionError("a segment that is no document's piece")


@pytest.mark.parametrize("add_bos", [None, False])
@pytest.mark.parametrize("name", TOKENIZERS)
def test_segments_are_the_eos_derived_boundaries(name, add_bos):
    """concat_chunk's rows are Megatron's: cut the BOS...EOS stream every L tokens and derive
    boundaries from EOS; tokens, labels, segments and positions agree, and so do the masks."""
    tok = load_tokenizer(name)
    bos = bos_for(name, add_bos)
    stream = np.concatenate(
        [doc if bos is None else np.concatenate(([bos], doc)) for doc in documents(name)]
    ).astype(np.int64)
    rows = list(make_packer("concat_chunk", SEQ_LEN, pad_id=tok.pad_id, bos_id=bos)
                .pack(documents(name)))  # fmt: skip
    full = len(stream) // SEQ_LEN - 1  # rows with a next token after them
    assert full >= 8
    windows = torch.as_tensor(
        np.stack([stream[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(full)])
    )
    for reset in (True, False):
        megatron = PackedBatch.from_eos(windows, int(tok.eos_id), reset_position_ids=reset)
        ours = collate_rows(rows[:full], reset_position_ids=reset, document_mask=True)
        assert [r[r > 0].tolist() for r in ours.seq_lens] == [
            r[r > 0].tolist() for r in megatron.seq_lens
        ]
        assert torch.equal(ours.tokens, megatron.tokens)
        assert torch.equal(ours.labels, megatron.labels)
        assert torch.equal(ours.position_ids, megatron.position_ids)
        assert torch.equal(ours.to_dense_mask(), megatron.to_dense_mask())
        if bos is not None:  # every document starts a segment with BOS, at position 0
            starts = ours.tokens == bos
            assert (ours.position_ids[starts] == 0).all() if reset else starts.any()


def test_the_datamodule_packs_llama3_rows_with_bos_and_eos(tmp_path_factory):
    """data.tokenizer=llama3 prepares the embedded corpus with Llama 3's ids; each document
    segment of a row starts with <|begin_of_text|> (or, with add_bos=false, does not)."""
    cache = tmp_path_factory.mktemp("cache")
    for add_bos in (None, False):
        config = DataConfig(tokenizer="llama3", seq_len=1024, micro_batch_size=2, val_rows=2,
                            cache_dir=str(cache), add_bos=add_bos)  # fmt: skip
        dm = LongCtxDataModule(config, rank=0, world_size=1)
        assert dm.manifest.tokenizer["kind"] == "llama3" and dm.vocab_size == 128256
        assert (dm.eos_id, dm.pad_id) == (128001, 128004)
        batch = next(iter(dm.train_dataloader()))
        is_bos = batch.tokens == 128000
        if add_bos is None:  # BOS starts documents (reset positions: position 0), nowhere else
            assert is_bos.any() and (batch.position_ids[is_bos] == 0).all()
            assert dm.validation_rows()[0].tokens[0] == 128000  # the first val document's start
        else:
            assert not is_bos.any()
        assert (batch.tokens == 128001).any() and batch.tokens.max() < 128256
        with pytest.raises(ValueError, match=r"vocab_size 128256 .* more than the model's 512"):
            dm.check_vocab(512)  # the tiny preset cannot hold Llama 3's ids


def test_a_folder_prepared_with_another_tokenizer_is_refused(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    from longctx.data.corpus import default_corpus_dir

    byte_folder = default_corpus_dir(cache)
    config = DataConfig(tokenizer="llama3", shards=[str(byte_folder)], cache_dir=str(cache))
    with pytest.raises(ValueError, match=r"prepared with tokenizer 'byte', not data.tokenizer="):
        _ = LongCtxDataModule(config, rank=0, world_size=1).manifest
    with pytest.raises(ValueError, match=r"DataConfig.tokenizer='llama4'; expected one of"):
        DataConfig(tokenizer="llama4")
