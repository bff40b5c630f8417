"""LongCtxDataModule: batch invariants, ablation comparability, sharding, exact and elastic
resume, errors."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import module, small_corpus, take

from longctx.batch import IGNORE_INDEX
from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.corpus import default_corpus_dir
from longctx.data.shards import ShardSet
from longctx.data.streams import DocumentStream, RowStream, StreamBatch, merge_rank_states


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The real embedded corpus, prepared once per session into a temp cache."""
    return default_corpus_dir(tmp_path_factory.mktemp("cache"))


def document_ids(batch) -> list[torch.Tensor]:
    return [torch.arange(len(r)).repeat_interleave(r.long()) for r in batch.seq_lens]


@pytest.mark.parametrize("packer", ["best_fit", "concat_chunk"])
@pytest.mark.parametrize("reset", [True, False])
def test_batches_hold_packed_batch_invariants_on_real_corpus(corpus, packer, reset):
    dm = module(
        corpus,
        seq_len=1024,
        micro_batch_size=2,
        packer=packer,
        reset_position_ids=reset,
        buffer_size=100,
        chunk_documents=1000,
    )
    train = ShardSet(corpus)
    text = np.concatenate([train.document(i) for i in range(train.num_documents)])
    text = text.astype(np.int32).tobytes()
    for batch in take(dm, 6):
        assert batch.tokens.shape == (2, 1024) and (batch.seq_lens.sum(1) == 1024).all()
        for row in range(2):
            lens = batch.seq_lens[row][batch.seq_lens[row] > 0].tolist()
            starts = np.cumsum([0] + lens[:-1])
            pos = batch.position_ids[row]
            want = torch.cat([torch.arange(n) for n in lens]) if reset else torch.arange(1024)
            assert torch.equal(pos, want)
            for start, n in zip(starts, lens, strict=True):
                seg_t = batch.tokens[row, start : start + n].numpy()
                seg_l = batch.labels[row, start : start + n].numpy()
                # inside a segment, a label is the next token; the segment's last label is
                # -100 (document end) or the continuation of a split document
                np.testing.assert_array_equal(
                    seg_l[:-1][seg_l[:-1] != IGNORE_INDEX], seg_t[1:][seg_l[:-1] != IGNORE_INDEX]
                )
                assert (seg_l[:-1] != IGNORE_INDEX).all() or (seg_t == dm.pad_id).all()
                eos_at = np.flatnonzero(seg_t == dm.eos_id)
                assert (seg_l[eos_at] == IGNORE_INDEX).all()  # no loss across documents
                if seg_t[0] != dm.pad_id:  # every document piece is real corpus text
                    assert _occurs(text, seg_t[: min(n, 64)])


def _occurs(text: bytes, piece: np.ndarray) -> bool:
    # int32 bytes: an unaligned false match would need impossible zero/non-zero byte patterns
    return piece.astype(np.int32).tobytes() in text


def test_ablation_arms_see_same_tokens_and_labels(corpus):
    L = 4096
    base = dict(seq_len=L, micro_batch_size=2, buffer_size=100, chunk_documents=1000)
    arms = {
        (m, r): take(module(corpus, document_mask=m, reset_position_ids=r, **base), 4)
        for m in (True, False)
        for r in (True, False)
    }
    ref = arms[(True, True)]
    assert max(b.seq_lens.shape[1] for b in ref) > 2  # the masked arm really has documents
    for (mask, reset), batches in arms.items():
        for got, want in zip(batches, ref, strict=True):
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
            if mask:
                assert torch.equal(got.seq_lens, want.seq_lens)
            else:
                assert got.seq_lens.tolist() == [[L]] * 2
            continuous = torch.arange(L).expand(2, L)
            assert torch.equal(got.position_ids, want.position_ids if reset else continuous)
    vals = {
        arm: list(
            module(
                corpus, document_mask=arm[0], reset_position_ids=arm[1], val_rows=4, **base
            ).val_dataloader()
        )
        for arm in arms
    }
    for batches in vals.values():
        for got, want in zip(batches, vals[(True, True)], strict=True):
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_streams_cover_an_epoch_disjointly_and_completely(tmp_path, streams):
    folder = small_corpus(tmp_path, 48)
    train = ShardSet(folder)
    share = 48 // streams
    config = DataConfig(
        shards=[str(folder)],
        seq_len=64,
        micro_batch_size=1,
        buffer_size=share // 2,
        chunk_documents=share,
        num_streams=streams,
    )
    dataset = LongCtxDataModule(config).train_dataset()
    seen_ids, seen_tokens = [], Counter()
    for k in range(streams):
        docs = dataset.open_stream(k).rows.docs
        seen_ids += docs.chunk_ids(0)  # chunk 0 = this stream's share of epoch 0
        rows = RowStream(docs, config, dataset.pad_id)
        for row in rows:
            if rows.cursor[0] > 0:
                break
            seen_tokens.update(row.tokens[row.tokens != dataset.pad_id].tolist())
    assert sorted(seen_ids) == [(0, d) for d in range(48)]
    want = Counter(np.concatenate([train.document(i) for i in range(48)]).tolist())
    assert seen_tokens == want


def rows_equal(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.tokens, y.tokens) and np.array_equal(x.seq_lens, y.seq_lens)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("packer", ["concat_chunk", "best_fit"])
@pytest.mark.parametrize("seq_len", [7, 32])
def test_a_row_stream_resumes_from_any_cursor(tmp_path, packer, seq_len):
    """Resume replays at most one chunk: a stream reopened at the cursor after row k yields the
    rows that followed row k, across chunk boundaries too."""
    folder = small_corpus(tmp_path, 48)
    config = DataConfig(
        shards=[str(folder)],
        seq_len=seq_len,
        micro_batch_size=1,
        packer=packer,
        buffer_size=2,
        chunk_documents=4,
    )
    docs = DocumentStream([ShardSet(folder)], np.ones(1), 0, 0, 1, config.chunk_documents)
    pad_id = ShardSet(folder).manifest.pad_id
    stream = RowStream(docs, config, pad_id)
    rows, cursors = [], []
    for row in stream:  # into the third chunk
        rows.append(row)
        cursors.append(stream.cursor)
        if stream.cursor[0] == 2:
            break
    for k in range(len(rows)):
        resumed = RowStream(docs, config, pad_id, cursors[k])
        assert rows_equal(list(itertools.islice(resumed, len(rows) - k - 1)), rows[k + 1 :]), k


ELASTIC = dict(seq_len=64, micro_batch_size=2, buffer_size=8, chunk_documents=24)


def ranks(folder, world: int, **config) -> list[LongCtxDataModule]:
    """The data modules of ranks 0..world-1 (simulated in one process)."""
    return [
        LongCtxDataModule(
            DataConfig(shards=[str(folder)], **ELASTIC, **config), rank=r, world_size=world
        )
        for r in range(world)
    ]


def take_rounds(modules: list[LongCtxDataModule], rounds: int) -> list[list[int]]:
    """The rows of ``rounds`` rounds, rank 0's micro-batch first in each: the global order."""
    per_rank = [take(dm, rounds) for dm in modules]
    return [row for n in range(rounds) for b in per_rank for row in b[n].tokens.tolist()]


@pytest.mark.parametrize("streams,workers", [(1, 0), (2, 0), (4, 2)])
def test_row_order_is_the_same_for_any_number_of_ranks(tmp_path, streams, workers):
    folder = small_corpus(tmp_path, 200)
    config = dict(num_streams=streams, num_workers=workers)
    order = take_rounds(ranks(folder, 1, **config), 12)
    assert len(order) == 24 and len({tuple(r) for r in order}) == 24  # 24 different rows
    for world in (2, 3) if workers else (2, 3, 4):
        assert take_rounds(ranks(folder, world, **config), 12 // world) == order, world


@pytest.mark.parametrize(
    "before,after,rounds,streams,workers",
    [(2, 1, 3, 2, 0), (2, 3, 3, 2, 0), (1, 2, 5, 1, 0), (3, 2, 2, 2, 2)],
)
def test_resume_on_another_number_of_ranks_continues_the_row_order(
    tmp_path, before, after, rounds, streams, workers
):
    """A checkpoint's state (merged over ranks) resumes on another data-parallel size at the
    next global row, streams shared by ranks included, also mid-round (5 rows on 2 ranks)."""
    folder = small_corpus(tmp_path, 200)
    config = dict(num_streams=streams, num_workers=workers)
    order = take_rounds(ranks(folder, 1, **config), 12)
    first = ranks(folder, before, **config)
    got = take_rounds(first, rounds)
    state = merge_rank_states([dm.state_dict() for dm in first])
    assert state["rows_consumed"] == 2 * before * rounds
    resumed = ranks(folder, after, **config)
    for dm in resumed:
        dm.load_state_dict(state)
    left = 12 - before * rounds
    got += take_rounds(resumed, -(-left // after))
    assert got[:24] == order


def test_next_epoch_uses_a_new_permutation(tmp_path):
    folder = small_corpus(tmp_path, 48)
    docs = DocumentStream([ShardSet(folder)], np.ones(1), 0, 0, 1, 96)
    ids = [d for _, d in docs.chunk_ids(0)]
    assert sorted(ids[:48]) == sorted(ids[48:]) == list(range(48))
    assert ids[:48] != ids[48:]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_exactly_the_same_batches(tmp_path, workers):
    folder = small_corpus(tmp_path, 200)
    config = dict(
        seq_len=128,
        micro_batch_size=2,
        buffer_size=8,
        chunk_documents=40,
        num_streams=2,
        num_workers=workers,
    )
    full = take(module(folder, **config), 14)
    first = module(folder, **config)
    got = take(first, 5)
    state = first.state_dict()
    resumed = module(folder, **config)
    resumed.load_state_dict(state)
    got += take(resumed, 9)
    assert [b.tokens.tolist() for b in got] == [b.tokens.tolist() for b in full]
    assert all(torch.equal(a.seq_lens, b.seq_lens) for a, b in zip(got, full, strict=True))
    other = take(module(folder, **{**config, "num_workers": 2 - workers}), 14)
    assert [b.tokens.tolist() for b in other] == [b.tokens.tolist() for b in full]


def test_resume_refuses_changed_settings(tmp_path):
    folder = small_corpus(tmp_path, 48)
    dm = module(folder, seq_len=64)
    take(dm, 2)
    other = module(folder, seq_len=128)
    with pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(dm.state_dict())
    more_workers = module(folder, seq_len=64, num_workers=2)
    with pytest.raises(ValueError, match=r"data.num_streams: 1 -> 2; .*set data.num_streams=1"):
        more_workers.load_state_dict(dm.state_dict())


def test_resume_refuses_a_state_from_before_elastic_resume(tmp_path):
    folder = small_corpus(tmp_path, 48)
    dm = module(folder, seq_len=64)
    take(dm, 2)
    state = dm.state_dict()
    old = {"version": 1, "fingerprint": state["fingerprint"], "ranks": {0: {"consumed": 2}}}
    with pytest.raises(
        ValueError, match=r"version 1, expected 2.*lacks \['rows_consumed', 'streams'\]"
    ):
        module(folder, seq_len=64).load_state_dict(old)
    with pytest.raises(RuntimeError, match=r"disagree on the global rows consumed \(\[2, 6\]\)"):
        merge_rank_states([state, {**state, "rows_consumed": 6}])


def test_shared_streams_are_named_with_the_fix(tmp_path):
    folder = small_corpus(tmp_path, 48)
    config = DataConfig(shards=[str(folder)], seq_len=64, micro_batch_size=1, num_streams=2)
    with pytest.warns(UserWarning, match="num_streams=2 is not a multiple of .* 4 x 1.*2x"):
        LongCtxDataModule(config, rank=0, world_size=4).train_dataset()


def test_lightning_resume_with_estimated_stepping_batches(tmp_path):
    import lightning as L

    folder = small_corpus(tmp_path, 60)

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def training_step(self, batch, idx):
            self.seen.append(batch.tokens.clone())
            return self.w * 0 + self.w.sum()

        def configure_optimizers(self):
            assert self.trainer.estimated_stepping_batches > 0  # builds the loader early
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps, ckpt=None, save=None):
        dm = LongCtxDataModule(
            DataConfig(
                shards=[str(folder)],
                seq_len=512,
                micro_batch_size=1,
                buffer_size=5,
                chunk_documents=20,
                num_streams=2,
            )
        )
        model = Recorder()
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return model.seen, dm

    full, dm = fit(9)
    assert dm.batches_per_epoch() < 9  # the run crosses a Lightning epoch boundary
    first, _ = fit(4, save=tmp_path / "k.ckpt")
    second, _ = fit(9, ckpt=str(tmp_path / "k.ckpt"))
    assert [t.tolist() for t in first + second] == [t.tolist() for t in full]


def test_long_document_is_split_not_dropped(tmp_path):
    folder = small_corpus(tmp_path, 24, long_doc=300)
    dm = LongCtxDataModule(
        DataConfig(
            shards=[str(folder)],
            seq_len=64,
            micro_batch_size=1,
            buffer_size=24,
            chunk_documents=24,
        )
    )
    rows = RowStream(dm.train_dataset().open_stream(0).rows.docs, dm.config, dm.pad_id)
    tokens = Counter()
    for row in rows:
        if rows.cursor[0] > 0:
            break
        tokens.update(row.tokens[row.tokens != dm.pad_id].tolist())
    train = ShardSet(folder)
    assert tokens == Counter(np.concatenate([train.document(i) for i in range(24)]).tolist())
    assert tokens[ord("Z")] == 300


def test_bad_configuration_fails_before_training(tmp_path):
    folder = small_corpus(tmp_path, 48)
    dm = module(folder, seq_len=64)
    with pytest.raises(ValueError, match="vocab_size 259.*more than the model's 200"):
        dm.check_vocab(200)
    dm.check_vocab(512)
    with pytest.raises(ValueError, match="fewer than one batch"):
        module(folder, seq_len=100_000).train_dataloader()
    with pytest.raises(ValueError, match="fewer than the 64 streams"):
        LongCtxDataModule(
            DataConfig(shards=[str(folder)], seq_len=8, micro_batch_size=1, num_streams=64)
        ).train_dataloader()
    with pytest.raises(ValueError, match="shards=\\[\\]"):
        LongCtxDataModule(DataConfig(shards=[])).setup("fit")
    with pytest.raises(ValueError, match="packer='greedy'"):
        DataConfig(packer="greedy")
    with pytest.raises(ValueError, match="val split .* fewer than val_rows"):
        list(module(folder, seq_len=64).val_dataloader())
    with pytest.raises(FileNotFoundError, match="manifest.json does not exist"):
        module(tmp_path / "nowhere")
    next(folder.glob("train-*.tokens.npy")).unlink()
    with pytest.raises(FileNotFoundError, match="is missing"):
        module(folder)


def test_config_is_a_plain_dataclass():
    assert dataclasses.asdict(DataConfig())["packer"] == "best_fit"


def test_train_batches_declare_their_origin_and_keep_it_when_moved(tmp_path):
    dm = module(small_corpus(tmp_path), seq_len=64)
    (batch,) = take(dm, 1)
    moved = batch.to("cpu")
    assert isinstance(moved, StreamBatch) and moved.origin == batch.origin
    assert batch.origin.first == 0 and batch.origin.positions[0][1].batches == 1


def test_held_out_documents_are_the_val_split_and_asking_for_more_is_refused(corpus):
    dm = module(corpus)
    count = ShardSet(corpus, "val").num_documents
    every = dm.val_documents(None)
    assert len(every) == count and [len(d) for d in dm.val_documents(3)] == [
        len(d) for d in every[:3]
    ]
    with pytest.raises(
        ValueError, match=f"num_documents={count + 1}: the val split .* has {count} "
    ):
        dm.val_documents(count + 1)
