"""The recall study's pieces (issue 53): MQAR documents, the answers-only loss, the MQAR corpus
as a prepared folder and a data.shards entry, and the held-out conditions and their scoring."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_fixtures import module, small_corpus, take

from longctx.batch import IGNORE_INDEX
from longctx.data.config import DataConfig
from longctx.data.mqar_corpus import STREAM, mqar_dir, write_corpus
from longctx.data.packing import collate_rows, make_packer
from longctx.data.shards import ShardSet, load_manifest
from longctx.model import Llama, LlamaConfig
from longctx.synthetic.mqar import (
    EOS,
    FIRST_KEY,
    MqarSpec,
    MqarVocab,
    answer_keys,
    mqar_document,
    power_law_gaps,
    tokenizer_spec,
)
from studies import recall_conditions
from studies.recall_conditions import Arm

VOCAB = MqarVocab(64, 64)
SPEC = MqarSpec(VOCAB, min_pairs=2, max_pairs=16)
KEYS = answer_keys("answers", tokenizer_spec(SPEC))
ARMS = [Arm(mask, reset) for mask in (True, False) for reset in (True, False)]


def documents(n: int, seed: int = 0, spec: MqarSpec = SPEC):
    rng = np.random.default_rng(seed)
    return [spec.document(rng) for _ in range(n)]


# --------------------------------------------------------------------------- the generator
def test_a_document_lists_its_pairs_then_queries_each_key_once_at_its_value():
    for doc in documents(200):
        t, q, k = doc.tokens, doc.query_positions, doc.key_positions
        pairs = len(q)
        keys, values = t[0 : 2 * pairs : 2], t[1 : 2 * pairs : 2]
        assert ((keys >= FIRST_KEY) & (keys < FIRST_KEY + VOCAB.num_keys)).all()
        assert ((values >= VOCAB.first_value) & (values < VOCAB.size)).all()
        assert len(set(keys.tolist())) == pairs  # a key is bound once per document
        assert sorted(t[q].tolist()) == sorted(keys.tolist())  # every key queried exactly once
        assert (np.diff(q) >= 2).all() and q.min() >= 2 * pairs  # queries after the pairs
        binding = dict(zip(keys.tolist(), values.tolist(), strict=True))
        assert doc.answers.tolist() == [binding[key] for key in t[q].tolist()]
        assert (t[k] == t[q]).all() and (doc.distances == q - k).all() and (q > k).all()
        assert t[-1] == EOS and (t[:-1] != EOS).all()
        # beyond the pairs and the queries, only filler
        rest = np.ones(len(t), bool)
        rest[: 2 * pairs] = rest[q] = rest[q + 1] = rest[-1] = False
        assert (t[rest] == 0).all()
        assert len(t) == SPEC.length(pairs) and SPEC.min_pairs <= pairs <= SPEC.max_pairs
    assert max(len(d.tokens) for d in documents(2000)) <= SPEC.max_doc_len


def test_power_law_gaps_are_distinct_slots_in_range_mostly_short():
    rng = np.random.default_rng(0)
    for slots, count in ((1, 1), (10, 10), (48, 32), (300, 5)):
        gaps = power_law_gaps(rng, slots, count, 0.01)
        assert len(set(gaps.tolist())) == count and gaps.min() >= 0 and gaps.max() < slots
        assert (np.diff(gaps) > 0).all()  # sorted
    short = np.concatenate([power_law_gaps(rng, 300, 1, 0.01) for _ in range(200)])
    assert np.median(short) < 30  # p(g) ~ g^-0.99: the mass sits on short gaps


@pytest.mark.parametrize(
    "build, named",
    [
        (lambda: mqar_document(np.random.default_rng(0), VOCAB, 65, 100), "num_pairs=65"),
        (lambda: mqar_document(np.random.default_rng(0), VOCAB, 0, 100), "num_pairs=0"),
        (lambda: mqar_document(np.random.default_rng(0), VOCAB, 8, 4), "4 query slots"),
        (lambda: MqarSpec(VOCAB, 2, 65), "65"),
        (lambda: MqarSpec(VOCAB, 5, 4), "[5, 4]"),
        (lambda: MqarSpec(VOCAB, slot_ratio=0.5), "slot_ratio=0.5"),
        (lambda: MqarSpec(VOCAB, slot_ratio=math.inf), "slot_ratio=inf"),
        (lambda: MqarSpec(VOCAB, power_a=math.nan), "power_a=nan"),
        (lambda: MqarSpec(VOCAB, power_a=0.0), "power_a=0.0"),
        (lambda: mqar_document(np.random.default_rng(0), VOCAB, 4, 8, math.nan), "nan"),
        (lambda: MqarVocab(True, 64), "num_keys=True"),
        (lambda: MqarVocab(64, 1), "num_values=1"),
        (lambda: MqarVocab(64.0, 64), "num_keys=64.0"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(build, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        build()


# --------------------------------------------------------------------------- answers only
def _query_labels(docs, row_start: int, seq_len: int) -> dict[int, int]:
    """Row position -> answer of every query whose document's pair block (for that key) lies in
    the row starting at stream offset ``row_start``."""
    out, offset = {}, 0
    for doc in docs:
        for q, k, answer in zip(doc.query_positions, doc.key_positions, doc.answers, strict=True):
            if row_start <= offset + k and offset + q < row_start + seq_len:
                out[offset + q - row_start] = int(answer)
        offset += len(doc.tokens)
    return out


def test_answers_only_labels_exactly_the_queries_of_a_packed_row():
    docs = documents(40)
    seq_len = sum(len(d.tokens) for d in docs)  # one row holding every document
    packer = make_packer("concat_chunk", seq_len, answer_keys=KEYS)
    (row,) = packer.pack(d.tokens for d in docs)
    expected = _query_labels(docs, 0, seq_len)
    labelled = np.flatnonzero(row.labels != IGNORE_INDEX)
    assert labelled.tolist() == sorted(expected)
    assert row.labels[labelled].tolist() == [expected[p] for p in sorted(expected)]
    assert len(expected) == sum(len(d.query_positions) for d in docs)


@pytest.mark.parametrize("seq_len", [17, 64, 100])
def test_a_split_document_never_labels_a_query_whose_key_is_in_another_row(seq_len):
    docs = documents(30, seed=1)
    packer = make_packer("concat_chunk", seq_len, answer_keys=KEYS)
    rows = list(packer.pack(d.tokens for d in docs))
    assert len(rows) > 3
    for i, row in enumerate(rows):
        expected = _query_labels(docs, i * seq_len, seq_len)
        labelled = np.flatnonzero(row.labels != IGNORE_INDEX)
        assert labelled.tolist() == sorted(expected), f"row {i}"
        assert row.labels[labelled].tolist() == [expected[p] for p in sorted(expected)]


def test_answers_only_wraps_best_fit_and_keeps_stats():
    packer = make_packer("best_fit", 128, answer_keys=KEYS, buffer_size=8)
    docs = documents(30, seed=2)
    rows = list(packer.pack(d.tokens for d in docs))
    assert packer.stats.rows == len(rows) and packer.stats.tokens == 128 * len(rows)
    labelled = sum(int((r.labels != IGNORE_INDEX).sum()) for r in rows)
    assert labelled == sum(len(d.query_positions) for d in docs)  # no document is split


def tiny_llama(seed: int = 0, vocab: MqarVocab = VOCAB) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab.size, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64,
        attn_backend="sdpa",
    )  # fmt: skip
    return Llama(config).eval()


def test_the_answers_only_loss_is_the_mean_cross_entropy_over_answers():
    docs = documents(12, seed=3)
    rows = list(make_packer("concat_chunk", 96, answer_keys=KEYS).pack(d.tokens for d in docs))
    batch = collate_rows(rows, reset_position_ids=True, document_mask=True)
    model = tiny_llama()
    total, count = model.loss(batch)
    with torch.no_grad():
        logits = F.linear(model.hidden_states(batch), model.output_weight)  # [B, L, V]
    answers = [(b, p) for b, r in enumerate(rows) for p in np.flatnonzero(r.labels >= 0)]
    by_hand = [
        -torch.log_softmax(logits[b, p].double(), -1)[int(rows[b].labels[p])] for b, p in answers
    ]
    assert count == len(answers) > 0
    assert float(total.detach()) / count == pytest.approx(
        float(torch.stack(by_hand).mean()), rel=1e-5
    )


# --------------------------------------------------------------------------- the corpus
def test_write_corpus_writes_an_mqar_manifest(tmp_path):
    manifest = write_corpus(tmp_path / "c", SPEC, documents=30, seed=0, val_documents=5)
    loaded = load_manifest(tmp_path / "c")
    assert loaded.tokenizer["kind"] == "mqar" and loaded.tokenizer == tokenizer_spec(SPEC)
    assert loaded.vocab_size == VOCAB.size and loaded.eos_id == EOS
    assert manifest.splits["train"].documents == 30 and manifest.splits["val"].documents == 5
    assert answer_keys("answers", loaded.tokenizer) == (FIRST_KEY, VOCAB.first_value)


def test_a_vocabulary_past_uint16_keeps_every_id(tmp_path):
    spec = MqarSpec(MqarVocab(70_000, 64), min_pairs=2, max_pairs=4)
    manifest = write_corpus(tmp_path / "c", spec, documents=20, seed=0, val_documents=0)
    assert manifest.dtype == "uint32"
    train = ShardSet(tmp_path / "c", "train")
    rng = np.random.default_rng([0, STREAM, 0])  # the train split's stream
    for i in range(train.num_documents):
        assert train.document(i).tolist() == spec.document(rng).tokens.tolist()


def test_mqar_dir_reuses_the_same_settings_and_writes_others_apart(tmp_path):
    def folder(**settings):
        (entry,) = DataConfig(shards=[{"mqar": {"documents": 20, "num_keys": 64,
                                                "num_values": 64, **settings}}]).shards  # fmt: skip
        return mqar_dir(entry, tmp_path)

    first = folder()
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert folder() == first and (first / "manifest.json").stat().st_mtime_ns == stamp
    other = folder(seed=1)
    assert other != first and folder(max_pairs=8) not in (first, other)
    assert load_manifest(other).tokenizer["num_keys"] == 64


def test_answers_loss_needs_an_mqar_corpus():
    with pytest.raises(ValueError, match="tokenizer is 'byte'"):
        answer_keys("answers", {"kind": "byte", "vocab_size": 256})
    assert answer_keys("all", {"kind": "byte"}) is None


def test_the_datamodule_reads_answer_keys_from_the_manifest_or_refuses(tmp_path):
    write_corpus(tmp_path / "mqar", SPEC, documents=60, seed=0, val_documents=20)
    dm = module(tmp_path / "mqar", seq_len=128, loss_tokens="answers", val_rows=1)
    assert dm.config.answer_keys == KEYS
    (row,) = dm.validation_rows()
    batches = [(b.tokens, b.labels) for b in take(dm, 2)]
    for tokens, labels in [(row.tokens, row.labels), *batches]:
        labelled = labels != IGNORE_INDEX
        assert labelled.any()
        assert (tokens[labelled] >= FIRST_KEY).all() and (
            tokens[labelled] < VOCAB.first_value
        ).all()
        assert (labels[labelled] >= VOCAB.first_value).all()  # a key asks, a value answers
    with pytest.raises(ValueError, match="tokenizer is 'byte'"):
        module(small_corpus(tmp_path), seq_len=64, loss_tokens="answers")


@pytest.mark.parametrize(
    "entry, named",
    [
        ({"mqar": {"documents": 10, "colour": 1}}, "colour"),
        ({"mqar": {"documents": 0}}, "documents=0"),
        ({"mqar": {"documents": True}}, "documents=True"),
        ({"mqar": {"documents": 10, "seed": -1}}, "seed=-1"),
        ({"mqar": {"documents": 10, "slot_ratio": 0.5}}, "slot_ratio=0.5"),
        ({"mqar": {"documents": 10, "num_keys": 1}}, "num_keys=1"),
        ({"mqar": {"documents": 10}, "extra": 1}, "extra"),
        ({"mqar": [1, 2]}, "[1, 2]"),
        ({"mqar": {"documents": 10, "max_pairs": 32.5}}, "max_pairs=32.5"),
        ({"mqar": {"documents": 10, "min_pairs": True}}, "min_pairs=True"),
        ({"mqar": {"documents": 10, "min_pairs": "3"}}, "min_pairs='3'"),
        ({"mqar": {"documents": 10, "slot_ratio": "x"}}, "slot_ratio='x'"),
    ],
)
def test_a_bad_mqar_entry_is_refused_naming_it(entry, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        DataConfig(shards=[entry])


# --------------------------------------------------------------------------- the conditions
def test_an_interference_row_rebinds_every_scored_key_in_an_earlier_document():
    for seed in range(60):
        row = recall_conditions.interference_row(np.random.default_rng(seed), SPEC, 256)
        assert row.scored == (len(row.docs) - 1,) and len(row.docs) >= 2
        target = row.docs[-1]
        earlier = {}  # key -> the values earlier documents bind it to
        for doc in row.docs[:-1]:
            t = doc.tokens
            keys, values = t[doc.key_positions], t[doc.key_positions + 1]
            assert len(set(keys.tolist())) == len(keys)  # still one binding per document
            assert (t[doc.query_positions] == keys).all()  # its queries follow its pairs
            assert (t[doc.query_positions + 1] == values).all()
            for key, value in zip(keys.tolist(), values.tolist(), strict=True):
                earlier.setdefault(key, set()).add(value)
        for key, value in zip(target.tokens[target.key_positions], target.answers, strict=True):
            assert int(key) in earlier, f"seed {seed}: key {key} not bound earlier"
            assert int(value) not in earlier[int(key)], f"seed {seed}: key {key} same value"
        assert len(row.packed().tokens) == 256


@pytest.mark.parametrize("condition", ["in_distribution_row", "interference_row"])
def test_rows_shorter_than_the_longest_document_are_refused(condition):
    with pytest.raises(
        ValueError, match=f"rows of 50 tokens .*longest document \\({SPEC.max_doc_len}"
    ):
        getattr(recall_conditions, condition)(np.random.default_rng(0), SPEC, 50)


def test_a_length_document_puts_its_first_query_at_least_the_target_past_its_key():
    for distance in (8, 100, 161, 512, 1024):
        for seed in range(20):
            row = recall_conditions.length_document(np.random.default_rng(seed), SPEC, 8, distance)
            assert row.distances()[0] >= distance and row.target_distance == distance
            assert row.packed().labels.tolist().count(IGNORE_INDEX) == row.length - 8


def test_records_name_condition_distance_and_correctness():
    row = recall_conditions.length_document(np.random.default_rng(0), SPEC, 4, 64)
    predictions = row.answers().copy()
    predictions[1] += 1
    out = list(recall_conditions.records([row], predictions))
    assert [r["correct"] for r in out] == [1, 0, 1, 1]
    assert {r["condition"] for r in out} == {"length"} and {r["target_distance"] for r in out} == {
        64
    }
    assert [r["distance"] for r in out] == row.distances().tolist()


def test_a_prefix_batch_is_the_batch_of_the_cut_tokens():
    row = recall_conditions.in_distribution_row(np.random.default_rng(0), SPEC, 256)
    packed = row.packed()
    for arm in ARMS:
        full = recall_conditions.batch_of([row], arm)
        for n in (1, int(packed.seq_lens[0]), int(packed.seq_lens[0]) + 1, 200, 256):
            cut = recall_conditions._prefix(full, n)
            ends = np.cumsum(packed.seq_lens)
            lens = [int(x) for x in packed.seq_lens[: int(np.searchsorted(ends, n)) + 1]]
            lens[-1] -= int(sum(lens)) - n
            direct = collate_rows(
                [type(packed)(packed.tokens[:n], packed.labels[:n], np.asarray(lens, np.int32))],
                reset_position_ids=arm.reset_position_ids,
                document_mask=arm.document_mask,
            )
            for name in ("tokens", "labels", "position_ids", "seq_lens"):
                assert torch.equal(getattr(cut, name), getattr(direct, name)), (arm, n, name)


@pytest.mark.parametrize("arm", ARMS, ids=str)
def test_generation_agrees_with_teacher_forcing_on_every_query(arm):
    model = tiny_llama(1)
    rng = np.random.default_rng(5)
    packed = recall_conditions.in_distribution_row(rng, SPEC, 256)
    # a prefill per query: the last two documents' queries (after others in the row) suffice
    packed = dataclasses.replace(packed, scored=packed.scored[-2:])
    for row in (packed, recall_conditions.interference_row(rng, SPEC, 256)):
        forced = recall_conditions.teacher_forced(model, [row], arm)
        assert len(forced) == len(row.answers()) > 0
        assert recall_conditions.generated(model, row, arm).tolist() == forced.tolist()


def test_the_masked_pair_predicts_alike_under_reset_and_continuous_positions():
    model = tiny_llama(2)
    rng = np.random.default_rng(6)
    rows = [recall_conditions.in_distribution_row(rng, SPEC, 256) for _ in range(2)]
    rows += [recall_conditions.interference_row(rng, SPEC, 256) for _ in range(2)]
    for row in rows:
        with torch.no_grad():
            logits = {
                reset: model.labelled_logits(recall_conditions.batch_of([row], Arm(True, reset)))
                for reset in (True, False)
            }
        reset = recall_conditions.teacher_forced(model, [row], Arm(True, True))
        continuous = recall_conditions.teacher_forced(model, [row], Arm(True, False))
        assert reset.tolist() == continuous.tolist()
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
    # without the mask the positions matter: the unmasked pair differs somewhere
    unmasked = [
        model.labelled_logits(recall_conditions.batch_of(rows[:1], Arm(False, r)))
        for r in (True, False)
    ]
    assert not torch.allclose(unmasked[0], unmasked[1], atol=1e-4)


# --------------------------------------------------------------------------- the scoring CLI
def test_scoring_refuses_a_run_not_trained_on_an_mqar_corpus(monkeypatch):
    from studies import recall as cli

    class Stored:  # a byte-corpus run: what read_stored_run gives the CLI
        def model_config(self, **_):
            return None

        def data_config(self):
            return DataConfig(shards=["embedded"])

    monkeypatch.setattr(cli, "read_stored_run", lambda run, targets: Stored())
    with pytest.raises(ValueError, match=re.escape("data.shards=['embedded']; expected one MQAR")):
        cli.score_run("r", None)


@pytest.mark.parametrize("counts", [["0", "0"], ["-1", "2"], ["2", "-1"]])
def test_scoring_refuses_no_or_negative_instance_counts(tmp_path, counts):
    from studies import recall as cli

    argv = ["r", "--out", str(tmp_path), "--rows", counts[0], "--docs", counts[1]]
    with pytest.raises(ValueError, match=re.escape(f"--rows {counts[0]} --docs {counts[1]}")):
        cli.main(argv)


def test_a_prepared_mqar_folder_states_its_distribution_and_a_run_on_it_is_scored_from_it(tmp_path):
    from studies.recall import corpus_spec, trained_spec

    spec = MqarSpec(MqarVocab(64, 80), min_pairs=3, max_pairs=9, slot_ratio=2.0)
    write_corpus(tmp_path / "mq", spec, documents=20, seed=3, val_documents=2)
    assert corpus_spec(tmp_path / "mq") == spec
    assert trained_spec("r", DataConfig(shards=[str(tmp_path / "mq")])) == spec
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"data.shards=['{tmp_path / 'other'}']")):
        trained_spec("r", DataConfig(shards=[str(tmp_path / "other")]))


def test_scoring_refuses_before_writing_anything(tmp_path):
    from studies.recall import main as score

    with pytest.raises(FileNotFoundError, match="does not exist"):
        score([str(tmp_path / "no_run"), "--out", str(tmp_path / "scores")])
    assert not (tmp_path / "scores").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=re.escape(f"--out {tmp_path / 'file'} is a file")):
        score([str(tmp_path / "no_run"), "--out", str(tmp_path / "file")])
