"""data.stages (a growing row length in one run) and data.length_upsampling, in process."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from data_fixtures import module, small_corpus, take
from helpers import compose

from longctx.data import DataConfig, LongCtxDataModule, ShardSet
from longctx.data.config import LengthUpsampling, Stage
from longctx.data.streams import (
    DocumentStream,
    RowStream,
    StageSchedule,
    merge_rank_states,
    slot_probabilities,
    upsampled_slots,
)
from longctx.train.preflight import ConfigError, preflight

# stage 0: 3 steps of 4 x 16; stage 1: steps 3-4 of 2 x 32; then 2 x 64 (data.seq_len)
STAGED = dict(
    seq_len=64,
    micro_batch_size=2,
    buffer_size=8,
    chunk_documents=24,
    stages=[Stage(3, 16, 4), Stage(5, 32, 2)],
)


def origins(batches) -> list[int]:
    return [b.origin.stage for b in batches]


def test_rows_grow_stage_by_stage(tmp_path):
    folder = small_corpus(tmp_path, 200)
    batches = take(module(folder, **STAGED), 8)
    assert [tuple(b.shape) for b in batches] == [(4, 16)] * 3 + [(2, 32)] * 2 + [(2, 64)] * 3
    assert origins(batches) == [0, 0, 0, 1, 1, 2, 2, 2]
    # with 2 micro-batches per step a stage lasts twice as many micro-batches
    dm = LongCtxDataModule(
        DataConfig(shards=[str(folder)], **STAGED), rank=0, world_size=1, accumulate_grad_batches=2
    )
    assert origins(take(dm, 12)) == [0] * 6 + [1] * 4 + [2] * 2


def test_a_stage_starts_each_stream_at_its_next_chunk(tmp_path):
    folder = small_corpus(tmp_path, 200)
    config = DataConfig(shards=[str(folder)], **STAGED)
    batches = take(module(folder, **STAGED), 5)
    docs = DocumentStream([ShardSet(folder)], np.ones(1), 0, 0, 1, 24)
    # stage 0 read 12 rows of 16 from chunk 0; stage 1 packs chunk 1 at 32
    stage1 = RowStream(docs, config.stage_configs()[1], pad_id=0, cursor=(1, 0))
    rows = [row.tokens.tolist() for row, _ in zip(stage1, range(4), strict=False)]
    assert [r for b in batches[3:] for r in b.tokens.tolist()] == rows


@pytest.mark.parametrize(
    "stop,streams,workers,upsample",
    [(2, 1, 0, None), (3, 2, 0, None), (4, 2, 2, None), (5, 2, 0, LengthUpsampling(60, 3))],
)
def test_resume_across_a_stage_boundary_is_exact(tmp_path, stop, streams, workers, upsample):
    """Interrupted just before (2), at (3) and just after (4, 5) a boundary, the batches go on
    exactly as in one uninterrupted pass."""
    folder = small_corpus(tmp_path, 200)
    config = dict(STAGED, num_streams=streams, num_workers=workers, length_upsampling=upsample)
    full = take(module(folder, **config), 9)
    first = module(folder, **config)
    got = take(first, stop)
    resumed = module(folder, **config)
    resumed.load_state_dict(first.state_dict())
    got += take(resumed, 9 - stop)
    assert [b.tokens.tolist() for b in got] == [b.tokens.tolist() for b in full]
    assert [b.seq_lens.tolist() for b in got] == [b.seq_lens.tolist() for b in full]


def test_resume_on_another_number_of_ranks_with_stages_is_refused(tmp_path):
    folder = small_corpus(tmp_path, 200)
    one = LongCtxDataModule(DataConfig(shards=[str(folder)], **STAGED), rank=0, world_size=1)
    take(one, 2)
    two = LongCtxDataModule(DataConfig(shards=[str(folder)], **STAGED), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"with 2 micro-batches per optimizer step .* written "
                       r"with 1, and its stages change at those micro-batches \(\[3, 5\], here "
                       r"\[6, 10\]\)"):  # fmt: skip
        two.load_state_dict(one.state_dict())


def test_schedule_counts_rows_across_stages():
    schedule = StageSchedule(DataConfig(**STAGED), micro_batches_per_step=2)
    assert schedule.starts == [0, 6, 10]
    assert [schedule.stage_of(u) for u in (0, 5, 6, 9, 10, 99)] == [0, 0, 1, 1, 2, 2]
    for u in (0, 4, 6, 7, 10, 13):
        rows = schedule.rows_before(u)
        assert schedule.micro_batches_for(rows) == u
    assert schedule.rows_before(8) == 6 * 4 + 2 * 2
    with pytest.raises(ValueError, match=r"23 rows, which ends inside a micro-batch of stage 0"):
        schedule.micro_batches_for(23)
    with pytest.raises(ValueError, match=r"25 rows, which ends inside a micro-batch of stage 1"):
        schedule.micro_batches_for(25)


def test_merged_state_keeps_the_later_stage():
    state = {"rows_consumed": 4, "streams": {0: [7, 1, 2, 0]}}
    later = {"rows_consumed": 4, "streams": {0: [1, 3, 1, 1]}}
    assert merge_rank_states([state, later])["streams"][0] == [1, 3, 1, 1]
    assert merge_rank_states([later, state])["streams"][0] == [1, 3, 1, 1]


def test_bad_stages_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"stages\[1\].until_step=3; expected more than "
                       r"stages\[0\].until_step=3"):  # fmt: skip
        DataConfig(stages=[dict(until_step=3, seq_len=16, micro_batch_size=1)] * 2)
    with pytest.raises(ValueError, match=r"DataConfig.stages\[0\].seq_len=0; expected an int"):
        DataConfig(stages=[dict(until_step=3, seq_len=0, micro_batch_size=1)])
    with pytest.raises(ValueError, match=r"DataConfig.stages='256'; expected a list"):
        DataConfig(stages="256")
    with pytest.raises(TypeError):
        DataConfig(stages=[dict(until_step=3, seq_len=16)])  # a field missing


def preflight_of(overrides: list[str], tmp_path):
    cfg = compose(["dry_run=true", *overrides], output_dir=tmp_path)
    from hydra.utils import instantiate

    parallel = instantiate(cfg.parallel)
    return preflight(cfg, instantiate(cfg.model), instantiate(cfg.data), parallel)


def test_stage_lengths_are_checked_before_training(tmp_path):
    stage = "data.stages=[{until_step:2,seq_len:512,micro_batch_size:1}]"
    with pytest.raises(ConfigError, match=r"data.stages\[0\].seq_len=512: L=512 > "
                       r"max_seq_len=256, the RoPE range"):  # fmt: skip
        preflight_of([stage, "data.seq_len=256", "+model.max_seq_len=256"], tmp_path)
    odd = "data.stages=[{until_step:2,seq_len:101,micro_batch_size:1}]"
    with pytest.raises(ConfigError, match=r"data.stages\[0\].seq_len=101, "
                       r"parallel.context_parallel=2, parallel.context_parallel_rounds=1: "):  # fmt: skip
        preflight_of([odd, "parallel.context_parallel=2", "trainer.devices=2"], tmp_path)
    preflight_of([stage, "data.seq_len=1024"], tmp_path)  # fits: no error


# ------------------------------------------------------------------ length upsampling
def test_long_documents_appear_factor_times_per_epoch(tmp_path):
    folder = small_corpus(tmp_path, 48, long_doc=500)
    source = ShardSet(folder)
    lengths = source.document_lengths()
    slots = upsampled_slots(lengths, 100, 3)
    epoch = len(slots)
    docs = DocumentStream([source], np.ones(1), 0, 0, 1, epoch, [slots])
    counts = np.bincount([d for _, d in docs.chunk_ids(0)], minlength=len(lengths))
    assert counts.tolist() == [3 if n >= 100 else 1 for n in lengths]
    assert (lengths >= 100).sum() >= 2  # the long one and a few of the 5-120 character ones


def test_per_source_upsampling_keeps_the_source_token_shares():
    lengths = [np.array([10, 10, 400, 20]), np.array([30, 30, 30, 300])]
    slots = [upsampled_slots(n, 100, 5) for n in lengths]
    weights = np.array([0.7, 0.3])

    def shares(p, slots):
        tokens = np.array([pi * n[s].mean() for pi, n, s in zip(p, lengths, slots, strict=True)])
        return tokens / tokens.sum()

    identity = [np.arange(4)] * 2
    kept = slot_probabilities(weights, lengths, slots, per_source=True)
    np.testing.assert_allclose(shares(kept, slots), shares(weights, identity), rtol=1e-12)
    globally = slot_probabilities(weights, lengths, slots, per_source=False)
    assert globally is weights  # every source's long documents gain alike: the mix moves
    assert not np.allclose(shares(globally, slots), shares(weights, identity))


def test_long_token_share_is_reported(tmp_path, caplog):
    folder = small_corpus(tmp_path, 48, long_doc=500)
    total = ShardSet(folder).num_tokens
    caplog.set_level(logging.INFO)
    module(folder, seq_len=64, length_upsampling=dict(min_tokens=501, factor=4))
    before, after = 501 / total, 4 * 501 / (total + 3 * 501)
    assert f"their token share {before:.1%} -> {after:.1%}" in caplog.text


def test_bad_upsampling_is_refused_naming_the_value(tmp_path):
    for factor in (0, 0.5, 2.5, True):
        with pytest.raises(ValueError, match=rf"length_upsampling.factor={factor!r}; expected a "
                           r"whole number >= 1"):  # fmt: skip
            LengthUpsampling(100, factor)
    folder = small_corpus(tmp_path, 48, long_doc=500)
    with pytest.raises(ValueError, match=r"min_tokens=502 is above every training document "
                       r"\(the longest has 501 tokens"):  # fmt: skip
        module(folder, seq_len=64, length_upsampling=dict(min_tokens=502, factor=2))
