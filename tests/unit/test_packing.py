"""Packers: every token once and in order, no label across a boundary, replayable."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.batch import IGNORE_INDEX
from longctx.data.packing import (
    PackedRow,
    collate_rows,
    make_packer,
)

PACKERS = ["concat_chunk", "best_fit"]
PAD_ID = 0
STRIDE = 100_000  # token of document d at position p is d * STRIDE + p + 1, never PAD_ID


def make_documents(lengths: list[int]) -> list[np.ndarray]:
    return [d * STRIDE + 1 + np.arange(n, dtype=np.int64) for d, n in enumerate(lengths)]


def decode(token: int) -> tuple[int, int]:
    return (token - 1) // STRIDE, (token - 1) % STRIDE


def pack_all(name: str, lengths: list[int], seq_len: int, buffer_size: int = 4, seed: int = 0):
    packer = make_packer(name, seq_len, pad_id=PAD_ID, buffer_size=buffer_size, seed=seed)
    rows = list(packer.pack(make_documents(lengths)))
    return packer, rows


def segments_of(row: PackedRow):
    """(start, stop) of each segment of the row, from seq_lens."""
    ends = np.cumsum(row.seq_lens)
    return list(zip(ends - row.seq_lens, ends, strict=True))


def document_pieces(rows: list[PackedRow]) -> dict[int, list[tuple[int, int]]]:
    """doc -> [(first position, length)] of its pieces; asserts each segment is one piece."""
    pieces: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        for start, stop in segments_of(row):
            tokens = row.tokens[start:stop]
            if (tokens == PAD_ID).all():
                assert (row.labels[start:stop] == IGNORE_INDEX).all(), "pad must have no loss"
                continue
            doc, first = decode(int(tokens[0]))
            expected = doc * STRIDE + 1 + first + np.arange(stop - start)
            assert (tokens == expected).all(), "a segment must be one contiguous document piece"
            pieces.setdefault(doc, []).append((first, stop - start))
    return pieces


def assert_labels_within_documents(rows: list[PackedRow], lengths: list[int]) -> None:
    for row in rows:
        for token, label in zip(row.tokens.tolist(), row.labels.tolist(), strict=True):
            if token == PAD_ID:
                assert label == IGNORE_INDEX
                continue
            doc, pos = decode(token)
            if pos == lengths[doc] - 1:  # a document's last token predicts nothing
                assert label == IGNORE_INDEX
            else:  # the next token of the same document, even when it sits in another row
                assert label == token + 1


lengths_st = st.lists(st.integers(1, 60), min_size=1, max_size=25)


@pytest.mark.parametrize("name", PACKERS)
@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24), buffer_size=st.integers(1, 6))
def test_every_token_once_in_order_and_labels_stay_in_documents(
    name, lengths, seq_len, buffer_size
):
    _, rows = pack_all(name, lengths, seq_len, buffer_size)
    for row in rows:
        assert row.tokens.shape == row.labels.shape == (seq_len,)
        assert row.tokens.dtype == row.labels.dtype == np.int64
        assert row.seq_lens.dtype == np.int32
        assert (row.seq_lens > 0).all() and row.seq_lens.sum() == seq_len
    pieces = document_pieces(rows)
    assert sorted(pieces) == list(range(len(lengths))), "every document appears"
    for doc, doc_pieces in pieces.items():
        covered = []
        for first, length in sorted(doc_pieces):
            covered.extend(range(first, first + length))
        assert covered == list(range(lengths[doc])), f"document {doc}: each token exactly once"
    assert_labels_within_documents(rows, lengths)


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24))
def test_concat_chunk_is_the_stream_cut_every_l_tokens(lengths, seq_len):
    _, rows = pack_all("concat_chunk", lengths, seq_len)
    stream = np.concatenate(make_documents(lengths))
    doc_ends = np.cumsum(lengths)
    expected_rows = -(-len(stream) // seq_len)
    assert len(rows) == expected_rows
    padded = np.full(expected_rows * seq_len, PAD_ID)
    padded[: len(stream)] = stream
    assert (np.stack([r.tokens for r in rows]).ravel() == padded).all()
    for r, row in enumerate(rows):  # segments cut at row starts and document ends only
        row_start = r * seq_len
        cuts = {0, seq_len} | {int(e) - row_start for e in doc_ends if 0 < e - row_start < seq_len}
        if len(stream) < row_start + seq_len:
            cuts.add(len(stream) - row_start)  # the final row's pad tail
        assert np.cumsum(row.seq_lens).tolist() == sorted(cuts - {0})


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24), buffer_size=st.integers(1, 6))
def test_best_fit_splits_only_documents_longer_than_l(lengths, seq_len, buffer_size):
    _, rows = pack_all("best_fit", lengths, seq_len, buffer_size)
    pieces = document_pieces(rows)
    for doc, length in enumerate(lengths):
        assert len(pieces[doc]) == -(-length // seq_len), f"document {doc} of {length} tokens"
    for row in rows:  # a pad segment can only be the row's tail
        pad = [(a, b) for a, b in segments_of(row) if (row.tokens[a:b] == PAD_ID).all()]
        assert pad in ([], [segments_of(row)[-1]])


@pytest.mark.parametrize("name", PACKERS)
@settings(max_examples=40, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24), buffer_size=st.integers(1, 6))
def test_stats_match_a_direct_count(name, lengths, seq_len, buffer_size):
    packer, rows = pack_all(name, lengths, seq_len, buffer_size)
    pad = sum(int((r.tokens == PAD_ID).sum()) for r in rows)
    segments = sum(len(r.seq_lens) for r in rows) - sum(int(r.tokens[-1] == PAD_ID) for r in rows)
    stats = packer.stats
    assert stats.rows == len(rows)
    assert stats.tokens == len(rows) * seq_len
    assert stats.pad_tokens == pad
    assert stats.efficiency == pytest.approx(sum(lengths) / (len(rows) * seq_len))
    assert stats.docs_per_row == pytest.approx(segments / len(rows))
    assert stats.splits == segments - len(lengths)  # k pieces of a document are k - 1 cuts


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize("name", PACKERS)
@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 24), batch=st.integers(1, 4))
def test_collate_rows_positions_follow_documents_and_mask_flag(
    name, reset, lengths, seq_len, batch
):
    _, rows = pack_all(name, lengths, seq_len)
    rows = rows[:batch]
    masked = collate_rows(rows, reset_position_ids=reset, document_mask=True)
    unmasked = collate_rows(rows, reset_position_ids=reset, document_mask=False)
    for b, row in enumerate(rows):
        expected = []
        for start, stop in segments_of(row):
            expected.extend(range(stop - start) if reset else range(start, stop))
        assert masked.position_ids[b].tolist() == expected
        assert masked.seq_lens[b][masked.seq_lens[b] > 0].tolist() == row.seq_lens.tolist()
        assert masked.tokens[b].tolist() == row.tokens.tolist()
        assert masked.labels[b].tolist() == row.labels.tolist()
    assert torch.equal(unmasked.tokens, masked.tokens)
    assert torch.equal(unmasked.labels, masked.labels)
    assert torch.equal(unmasked.position_ids, masked.position_ids)
    assert unmasked.seq_lens.tolist() == [[seq_len]] * len(rows)


# ----------------------------------------------------------------------------- resume
def rows_equal(a: list[PackedRow], b: list[PackedRow]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.tokens, y.tokens)
        and np.array_equal(x.labels, y.labels)
        and np.array_equal(x.seq_lens, y.seq_lens)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("name", PACKERS)
@settings(max_examples=30, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(1, 16), data=st.data())
def test_a_replayed_packer_yields_the_same_rows(name, lengths, seq_len, data):
    """A resumed run replays its packer (longctx.data.streams): a fresh packer over the same
    documents yields, after any k rows, what the first one yielded."""
    documents = make_documents(lengths)
    first = list(make_packer(name, seq_len, buffer_size=3, seed=3).pack(documents))
    k = data.draw(st.integers(0, len(first)))
    replay = make_packer(name, seq_len, buffer_size=3, seed=3).pack(documents)
    assert rows_equal(list(itertools.islice(replay, k, None)), first[k:])


# ----------------------------------------------------------------------------- best_fit
def test_best_fit_splits_a_long_document_instead_of_dropping_it():
    packer, rows = pack_all("best_fit", [25, 3], seq_len=8, buffer_size=2)
    assert sorted(document_pieces(rows)[0]) == [(0, 8), (8, 8), (16, 8), (24, 1)]
    assert packer.stats.splits == 3
    assert sum(r.tokens.size - int((r.tokens == PAD_ID).sum()) for r in rows) == 28


def test_best_fit_places_each_document_in_the_tightest_row():
    # Decreasing order 6, 5, 3, 2 into L=8: 6 -> row A (free 2), 5 -> row B (free 3),
    # 3 -> row B (tightest that fits: free 3), 2 -> row A (free 2). Both rows full.
    packer, rows = pack_all("best_fit", [3, 6, 2, 5], seq_len=8, buffer_size=4)
    contents = sorted(sorted(doc for doc, _ in _docs_in(row)) for row in rows)
    assert contents == [[0, 3], [1, 2]]
    assert packer.stats.efficiency == 1.0


def _docs_in(row: PackedRow):
    return [decode(int(row.tokens[a])) for a, _ in segments_of(row)]


def test_best_fit_is_deterministic_given_the_seed():
    lengths = np.random.default_rng(0).integers(1, 40, size=60).tolist()
    _, first = pack_all("best_fit", lengths, 16, buffer_size=20, seed=5)
    _, second = pack_all("best_fit", lengths, 16, buffer_size=20, seed=5)
    assert rows_equal(first, second)


def test_best_fit_efficiency_on_many_short_documents():
    lengths = np.random.default_rng(0).integers(1, 200, size=2000).tolist()
    packer, _ = pack_all("best_fit", lengths, 1024, buffer_size=500)
    assert packer.stats.efficiency > 0.99


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", PACKERS)
@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_bad_seq_len_is_refused(name, seq_len):
    with pytest.raises(ValueError, match=rf"seq_len={seq_len!r}; expected an integer >= 1"):
        make_packer(name, seq_len)


@pytest.mark.parametrize("buffer_size", [0, -1])
def test_bad_buffer_size_is_refused(buffer_size):
    with pytest.raises(ValueError, match=rf"buffer_size={buffer_size}; expected an integer"):
        make_packer("best_fit", 8, buffer_size=buffer_size)


def test_unknown_packer_is_refused():
    with pytest.raises(ValueError, match="unknown packer 'greedy'"):
        make_packer("greedy", 8)


@pytest.mark.parametrize("name", PACKERS)
@pytest.mark.parametrize(
    ("document", "message"),
    [
        (np.zeros(0, dtype=np.int64), "document 1 is empty"),
        (np.ones((2, 3), dtype=np.int64), r"document 1 has shape \(2, 3\); expected a 1-D"),
        (np.ones(3, dtype=np.float32), "document 1 has dtype float32; expected an integer"),
        (np.ones(3, dtype=bool), "document 1 has dtype bool; expected an integer"),
    ],
)
def test_bad_documents_are_refused(name, document, message):
    packer = make_packer(name, 4, buffer_size=1)
    with pytest.raises(ValueError, match=message):
        list(packer.pack([np.arange(5), document]))


def test_collate_rows_refuses_bad_rows():
    good = PackedRow(np.arange(4), np.arange(4), np.array([4], dtype=np.int32))
    with pytest.raises(ValueError, match="no rows"):
        collate_rows([], reset_position_ids=True, document_mask=True)
    short = PackedRow(np.arange(3), np.arange(3), np.array([3], dtype=np.int32))
    with pytest.raises(ValueError, match=r"row 1 tokens has shape \(3,\)"):
        collate_rows([good, short], reset_position_ids=True, document_mask=True)
    bad_lens = PackedRow(np.arange(4), np.arange(4), np.array([2, 1], dtype=np.int32))
    with pytest.raises(ValueError, match=r"row 0 seq_lens \[2, 1\] must be positive and sum"):
        collate_rows([bad_lens], reset_position_ids=False, document_mask=False)
