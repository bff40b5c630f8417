"""PackedBatch: the discussion's mask, from_eos against a loop reference, round trips, errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.batch import DENSE_MASK_MAX_LEN, IGNORE_INDEX, PackedBatch

# The 3-D mask printed in packing-discussion.txt for attention_mask_in_length
# [[2, 3], [3, 2], [6, 0]] with batch 3 and seqlen 6.
DISCUSSION_MASK = [
    [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ],
    [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ],
    [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ],
]


@pytest.mark.parametrize("seq_lens", [[[2, 3], [3, 2], [6, 0]], [[2, 3, 1], [3, 2, 1], [6, 0, 0]]])
def test_discussion_example_mask_byte_for_byte(seq_lens):
    tokens = torch.arange(18).view(3, 6)
    batch = PackedBatch.from_lengths(tokens, seq_lens, reset_position_ids=True)
    assert batch.to_dense_mask().int().tolist() == DISCUSSION_MASK
    assert batch.seq_lens.tolist() == [[2, 3, 1], [3, 2, 1], [6, 0, 0]]
    assert batch.cu_seqlens.tolist() == [0, 2, 5, 6, 9, 11, 12, 18]
    assert batch.max_seqlen == 6 and batch.num_segments == 7


# ----------------------------------------------------------------------------- from_eos
def reference_from_eos(stream: list[list[int]], eos_id: int, reset: bool):
    """Plain loops: rows of L+1 stream tokens -> tokens, labels, positions, seq_lens."""
    tokens, labels, positions, seq_lens = [], [], [], []
    for row in stream:
        row_tokens, row_labels, row_positions, row_lens = [], [], [], []
        segment_len = 0
        for i in range(len(row) - 1):
            row_tokens.append(row[i])
            row_labels.append(IGNORE_INDEX if row[i] == eos_id else row[i + 1])
            row_positions.append(segment_len if reset else i)
            segment_len += 1
            if row[i] == eos_id or i == len(row) - 2:
                row_lens.append(segment_len)
                segment_len = 0
        tokens.append(row_tokens)
        labels.append(row_labels)
        positions.append(row_positions)
        seq_lens.append(row_lens)
    width = max(len(r) for r in seq_lens)
    seq_lens = [r + [0] * (width - len(r)) for r in seq_lens]
    return tokens, labels, positions, seq_lens


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize("seed", range(20))
def test_from_eos_matches_a_loop_reference(reset, seed):
    rng = random.Random(seed)
    eos_id = rng.randrange(4)
    b, length = rng.randint(1, 5), rng.randint(1, 20)
    # a small vocabulary makes EOS frequent, including runs of EOS and EOS at row ends
    stream = [[rng.randrange(6) for _ in range(length + 1)] for _ in range(b)]
    batch = PackedBatch.from_eos(torch.tensor(stream), eos_id, reset_position_ids=reset)
    tokens, labels, positions, seq_lens = reference_from_eos(stream, eos_id, reset)
    assert batch.tokens.tolist() == tokens
    assert batch.labels.tolist() == labels
    assert batch.position_ids.tolist() == positions
    assert batch.seq_lens.tolist() == seq_lens
    assert batch.tokens.dtype == batch.labels.dtype == batch.position_ids.dtype == torch.int64
    assert batch.seq_lens.dtype == torch.int32


# ----------------------------------------------------------------------------- round trips
@st.composite
def rows_of_lengths(draw):
    """(L, per-row segment lengths) where each row sums to at most L."""
    length = draw(st.integers(1, 24))
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        left, row = length, []
        while left and draw(st.booleans()) or not row:
            n = draw(st.integers(1, left))
            row.append(n)
            left -= n
        rows.append(row)
    return length, rows


def full_rows(length: int, rows: list[list[int]]) -> list[list[int]]:
    """Each row with its remainder segment, as from_lengths documents it."""
    return [r + [length - sum(r)] if sum(r) < length else r for r in rows]


def loop_mask(length: int, rows: list[list[int]]) -> list:
    masks = []
    for row in rows:
        doc = [s for s, n in enumerate(row) for _ in range(n)]
        masks.append([[doc[i] == doc[j] and j <= i for j in range(length)] for i in range(length)])
    return masks


@settings(max_examples=60, deadline=None)
@given(case=rows_of_lengths(), reset=st.booleans())
def test_lengths_cu_seqlens_doc_ids_and_mask_agree(case, reset):
    length, rows = case
    tokens = torch.randint(0, 50, (len(rows), length))
    padded = [r + [0] * (max(map(len, rows)) - len(r)) for r in rows]
    batch = PackedBatch.from_lengths(tokens, padded, reset_position_ids=reset)
    expected = full_rows(length, rows)
    flat = [n for row in expected for n in row]

    assert batch.cu_seqlens.dtype == torch.int32
    assert torch.diff(batch.cu_seqlens).tolist() == flat
    assert batch.cu_seqlens[-1] == len(rows) * length
    assert batch.max_seqlen == max(flat) and batch.num_segments == len(flat)
    for b, row in enumerate(expected):
        counts = torch.bincount(batch.doc_ids[b], minlength=len(row))
        assert counts[: len(row)].tolist() == row
        assert batch.doc_ids[b].tolist() == sorted(batch.doc_ids[b].tolist())
    assert batch.to_dense_mask().tolist() == loop_mask(length, expected)
    positions = [
        [i for n in row for i in range(n)] if reset else list(range(length)) for row in expected
    ]
    assert batch.position_ids.tolist() == positions


@settings(max_examples=40, deadline=None)
@given(case=rows_of_lengths())
def test_default_labels_are_next_token_within_segment(case):
    length, rows = case
    tokens = torch.randint(0, 50, (len(rows), length))
    batch = PackedBatch.from_lengths(tokens, full_rows(length, rows), reset_position_ids=False)
    for b, row in enumerate(full_rows(length, rows)):
        ends = set(np.cumsum(row) - 1)
        for i in range(length):
            expected = IGNORE_INDEX if i in ends else int(tokens[b, i + 1])
            assert int(batch.labels[b, i]) == expected
    assert batch.num_loss_tokens == len(rows) * length - sum(
        len(r) for r in full_rows(length, rows)
    )


# ----------------------------------------------------------------------------- bad input
TOKENS = torch.arange(12).view(2, 6)


@pytest.mark.parametrize(
    ("seq_lens", "message"),
    [
        ([[2, -1], [6, 0]], r"seq_lens row 0 has negative lengths"),
        (torch.tensor([[2, 4], [6, -6]]), r"seq_lens row 1 has negative lengths"),
        (torch.tensor([[2.0, 4.0], [6.0, 0.0]]), r"seq_lens has dtype torch.float32"),
        ([[2.0, 4.0], [6, 0]], r"seq_lens row 0 has non-integer lengths \[2.0, 4.0\]"),
        ([[4, 3], [6, 0]], r"seq_lens row 0 sums to 7 > L=6"),
        ([[6]], r"seq_lens has 1 rows, tokens has 2"),
        ([[6], [0]], r"seq_lens row 1 is empty"),
        ([[0, 6], [6, 0]], r"seq_lens row 0 has a zero before a positive length"),
    ],
)
def test_from_lengths_refuses_bad_lengths(seq_lens, message):
    with pytest.raises(ValueError, match=message):
        PackedBatch.from_lengths(TOKENS, seq_lens, reset_position_ids=True)


def test_mismatched_shapes_and_dtypes_are_refused():
    with pytest.raises(
        ValueError, match=r"labels has shape \(2, 5\), expected the shape of tokens"
    ):
        PackedBatch.from_lengths(TOKENS, [[6], [6]], True, labels=torch.zeros(2, 5, dtype=int))
    with pytest.raises(ValueError, match=r"tokens has dtype torch.float32, expected an integer"):
        PackedBatch.from_lengths(TOKENS.float(), [[6], [6]], reset_position_ids=True)
    with pytest.raises(ValueError, match=r"seq_lens has 1 rows, tokens has 2"):
        PackedBatch(TOKENS, TOKENS, TOKENS, torch.tensor([[6]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens row 1 sums to 5, expected L=6"):
        PackedBatch(TOKENS, TOKENS, TOKENS, torch.tensor([[6], [5]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"tokens has an empty row \(L = 0\)"):
        empty = torch.zeros(2, 0, dtype=torch.int64)
        PackedBatch(empty, empty, empty, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"token_stream has rows of 1 tokens, expected L\+1 >= 2"):
        PackedBatch.from_eos(torch.zeros(2, 1, dtype=torch.int64), 0, True)


def test_dense_mask_refuses_long_rows():
    length = DENSE_MASK_MAX_LEN + 1
    batch = PackedBatch.from_lengths(torch.zeros(1, length, dtype=int), [[length]], False)
    with pytest.raises(ValueError, match=rf"to_dense_mask\(\) refuses L={length}"):
        batch.to_dense_mask()


# ----------------------------------------------------------------------------- movement
def example_batch() -> PackedBatch:
    return PackedBatch.from_lengths(TOKENS, [[2, 3], [6, 0]], reset_position_ids=True)


def assert_same_values(a: PackedBatch, b: PackedBatch) -> None:
    for name in ("tokens", "labels", "position_ids", "seq_lens", "cu_seqlens", "doc_ids"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert a.max_seqlen == b.max_seqlen and a.num_loss_tokens == b.num_loss_tokens


def test_to_and_pin_memory_keep_values():
    batch = example_batch()
    _ = batch.cu_seqlens  # a cached derived value must travel with the batch
    assert_same_values(batch.to("cpu"), batch)
    if torch.cuda.is_available():
        pinned = batch.pin_memory()
        assert pinned.tokens.is_pinned() and pinned.cu_seqlens.is_pinned()
        assert_same_values(pinned, batch)
        assert_same_values(batch.to("cuda"), batch)


def test_dataloader_pass_through_keeps_the_batch():
    batch = example_batch()
    loader = torch.utils.data.DataLoader([batch], batch_size=1, collate_fn=lambda x: x[0])
    (out,) = list(loader)
    assert isinstance(out, PackedBatch)
    assert_same_values(out, batch)


def test_empty_batch_and_missing_eos_id_are_named():
    with pytest.raises(ValueError, match=r"B = 0"):
        PackedBatch.from_lengths(torch.zeros(0, 8, dtype=torch.long), torch.zeros(0, 1), True)
    with pytest.raises(ValueError, match=r"token_stream .*B = 0"):
        PackedBatch.from_eos(torch.zeros(0, 9, dtype=torch.long), 1, True)
    with pytest.raises(ValueError, match=r"eos_id=None"):
        PackedBatch.from_eos(torch.arange(9).view(1, 9), None, True)


def test_uint16_tokens_and_numpy_lengths_work():
    """What a memory-mapped shard gives: torch.from_numpy keeps numpy's uint16."""
    ids = np.array([[5, 6, 1, 7, 8, 9, 1, 4, 3]], dtype=np.uint16)
    expected = PackedBatch.from_eos(torch.from_numpy(ids.astype(np.int64)), 1, True)
    from_uint16 = PackedBatch.from_eos(torch.from_numpy(ids), 1, True)
    assert torch.equal(from_uint16.tokens, expected.tokens)
    assert torch.equal(from_uint16.labels, expected.labels)
    assert from_uint16.tokens.dtype == torch.int64
    lengths = [[3, 5]], np.array([[3, 5]]), [np.array([3, 5], dtype=np.int64)]
    batches = [PackedBatch.from_lengths(torch.from_numpy(ids[:, :8]), s, True) for s in lengths]
    for batch in batches:
        assert batch.seq_lens.tolist() == [[3, 5]]
        assert torch.equal(batch.labels, batches[0].labels)
