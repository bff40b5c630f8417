"""python -m longctx.data.convert: Megatron .bin/.idx (written to its spec here, and by
datatrove's Megatron writer), datatrove .ds/.index (by datatrove's own tokenizer step) and HF
datasets save_to_disk folders become prepared folders with the same documents; bad sources
are refused with the file and the value named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from longctx.data.convert import MEGATRON_HEADER, convert, main, vocabulary
from longctx.data.shards import MANIFEST_NAME, ShardSet, Vocabulary, load_manifest

VOCAB = Vocabulary(vocab_size=1000, eos_id=999, pad_id=999, spec={"kind": "external", "name": "t"})
RNG = np.random.default_rng(0)
# documents of 1..40 tokens; one empty (a converter skips it and counts it)
DOCS = [RNG.integers(0, 999, RNG.integers(1, 40)).astype(np.int64) for _ in range(50)]
DOCS[7] = np.zeros(0, np.int64)


def all_documents(folder: Path) -> list[list[int]]:
    """Documents of both splits in source order (each split keeps source order)."""
    manifest = load_manifest(folder)
    out = []
    for split in ("train", "val"):
        shards = ShardSet(folder, split)
        out += [shards.document(i).tolist() for i in range(shards.num_documents)]
    assert manifest.splits["train"].documents + manifest.splits["val"].documents == len(out)
    return out


def non_empty(docs) -> list[list[int]]:
    return [d.tolist() for d in docs if len(d)]


def same_documents_in_order(folder: Path, docs) -> None:
    """Every document, once, with its boundaries; within each split in source order."""
    got = all_documents(folder)
    assert sorted(map(tuple, got)) == sorted(map(tuple, non_empty(docs)))
    want_order = [tuple(d) for d in non_empty(docs)]
    for split in ("train", "val"):
        shards = ShardSet(folder, split)
        split_docs = [tuple(shards.document(i).tolist()) for i in range(shards.num_documents)]
        positions = [want_order.index(d) for d in split_docs]
        assert positions == sorted(positions), split


# --------------------------------------------------------------------------- Megatron
def write_megatron(prefix: Path, documents: list[list[np.ndarray]], dtype=np.uint16, code=8):
    """MMapIndexedDataset, byte for byte from Megatron-LM's _IndexWriter: header, version 1,
    dtype code, sequence count, document count, int32 sizes, int64 pointers, int64 doc_idx."""
    sequences = [s for doc in documents for s in doc]
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(s, dtype).tobytes() for s in sequences))
    sizes = np.array([len(s) for s in sequences], np.int32)
    pointers = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc_idx = np.cumsum([0] + [len(doc) for doc in documents]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MEGATRON_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def test_megatron_documents_of_several_sequences(tmp_path):
    # document d = sequences (sentences) laid end to end; doc 7 has no sequence at all
    split_docs = [[d[: len(d) // 2], d[len(d) // 2 :]] if len(d) > 3 else [d] for d in DOCS]
    split_docs[7] = []
    write_megatron(tmp_path / "corpus_text_document", split_docs)
    m = convert(tmp_path / "corpus_text_document", tmp_path / "out", VOCAB, val_fraction=0.2)
    same_documents_in_order(tmp_path / "out", DOCS)
    assert m.skipped_empty_documents == 1 and m.dtype == "uint16"
    assert m.sources[0]["format"] == "megatron" and set(m.sources[0]["tokens_sha256"]) == {
        "train",
        "val",
    }
    again = convert(
        tmp_path / "corpus_text_document.bin", tmp_path / "out", VOCAB, val_fraction=0.2
    )
    assert again == m  # a no-op rerun (the .bin path names the same dataset)


@pytest.mark.parametrize("token_size", [2, 4])
def test_megatron_written_by_datatrove(tmp_path, token_size):
    from datatrove.pipeline.tokens.megatron_tokenizer import MegatronTokenizedFile

    writer = MegatronTokenizedFile(str(tmp_path), "dt", token_size=token_size)
    for doc in DOCS:
        writer.write(doc.tolist())
    writer.close()
    convert(tmp_path / "dt", tmp_path / "out", VOCAB, val_fraction=0.2)
    same_documents_in_order(tmp_path / "out", DOCS)


def test_megatron_index_disagreeing_with_its_tokens_is_refused(tmp_path):
    write_megatron(tmp_path / "c", [[d] for d in DOCS if len(d)])
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"c.bin has \d+; the index disagrees with its token file"):
        convert(tmp_path / "c", tmp_path / "o1", VOCAB)
    write_megatron(tmp_path / "c", [[d] for d in DOCS if len(d)])
    pointer_at = 34 + 49 * 4 + 3 * 8  # sequence 3's pointer
    (tmp_path / "c.idx").write_bytes(
        idx[:pointer_at] + struct.pack("<q", 1) + idx[pointer_at + 8 :]
    )
    with pytest.raises(ValueError, match=r"sequence 3 has pointer 1 .* disagrees with its token"):
        convert(tmp_path / "c", tmp_path / "o2", VOCAB)
    (tmp_path / "c.idx").write_bytes(idx[:-8])
    with pytest.raises(ValueError, match=r"c.idx: \d+ bytes, but its header .* truncated"):
        convert(tmp_path / "c", tmp_path / "o3", VOCAB)
    (tmp_path / "c.idx").write_bytes(b"TNTIDX\x00\x00\x00" + idx[9:])
    with pytest.raises(ValueError, match=r"c.idx: starts with b'TNTIDX.*expected b'MMIDIDX"):
        convert(tmp_path / "c", tmp_path / "o4", VOCAB)
    assert not any((tmp_path / f"o{i}" / MANIFEST_NAME).exists() for i in range(1, 5))


def test_token_id_beyond_the_stated_vocabulary_is_refused(tmp_path):
    docs = [[np.array([1, 2, 3])], [np.array([4, 1500, 6])]]
    write_megatron(tmp_path / "c", docs)
    with pytest.raises(
        ValueError,
        match=r"document 1 holds token id 1500, outside the stated vocabulary \[0, 1000\)",
    ):
        convert(tmp_path / "c", tmp_path / "out", VOCAB)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_corrupt_copy_fails_the_token_checksum(tmp_path, monkeypatch):
    from longctx.data import shards

    write_megatron(tmp_path / "c", [[d] for d in DOCS if len(d)])
    real_add = shards.SplitWriter.add
    monkeypatch.setattr(shards.SplitWriter, "add", lambda self, ids: real_add(self, ids[::-1]))
    with pytest.raises(RuntimeError, match="token checksum .* differs from the source's"):
        convert(tmp_path / "c", tmp_path / "out", VOCAB)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


# --------------------------------------------------------------------------- datatrove
def tiny_tokenizer_file(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<eos>"] + [f"w{i}" for i in range(30)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder / "tokenizer.json"


def datatrove_tokenize(tmp_path: Path, texts: list[str], tasks: int = 2) -> Path:
    """datatrove's own DocumentTokenizer, task k tokenising texts[k::tasks] in order."""
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    def read(data, rank: int = 0, world_size: int = 1):  # a datatrove pipeline callable
        for i, text in enumerate(texts[rank::world_size]):
            yield Document(text=text, id=f"{rank}/{i}")

    tokenizer = tiny_tokenizer_file(tmp_path / "tok")
    out = tmp_path / "ds"
    LocalPipelineExecutor(
        [
            read,
            DocumentTokenizer(str(out), str(tokenizer), eos_token="<eos>", shuffle_documents=False),
        ],
        tasks=tasks,
        workers=1,
        logging_dir=str(tmp_path / "logs"),
    ).run()
    return out


TEXTS = [" ".join(f"w{(i * 7 + j) % 30}" for j in range(i % 13 + 1)) for i in range(40)]


def test_datatrove_tokenized_output(tmp_path):
    from tokenizers import Tokenizer

    out = datatrove_tokenize(tmp_path, TEXTS)
    assert sorted(p.name for p in out.glob("*.ds")) == [
        "00000_unshuffled.ds",
        "00001_unshuffled.ds",
    ]
    vocab = vocabulary(str(tmp_path / "tok"), None, None, None, "")
    m = convert(out, tmp_path / "prepared", vocab, val_fraction=0.2)
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    in_file_order = [t for k in range(2) for t in TEXTS[k::2]]  # file 0's documents, then file 1's
    want = [np.array(tok.encode(t).ids + [1]) for t in in_file_order]
    same_documents_in_order(tmp_path / "prepared", want)
    assert m.tokenizer["kind"] == "hf" and m.eos_id == 1 and m.vocab_size == 32


def test_datatrove_without_boundaries_needs_a_declared_document_length(tmp_path):
    out = datatrove_tokenize(tmp_path, TEXTS, tasks=1)
    (ds,) = out.glob("*.ds")
    Path(f"{ds}.index").unlink()
    vocab = vocabulary(str(tmp_path / "tok"), None, None, None, "")
    with pytest.raises(
        ValueError,
        match=r"no 00000_unshuffled.ds.index, so no document boundaries.*--document-length",
    ):
        convert(out, tmp_path / "p1", vocab)
    m = convert(out, tmp_path / "p2", vocab, document_length=16, val_fraction=0.0)
    shards = ShardSet(tmp_path / "p2")
    lengths = [len(shards.document(i)) for i in range(len(shards))]
    total = ds.stat().st_size // 2
    assert lengths == [16] * (total // 16) + ([total % 16] if total % 16 else [])
    assert m.splits["train"].tokens == total


def test_datatrove_index_disagreeing_with_its_tokens_is_refused(tmp_path):
    out = datatrove_tokenize(tmp_path, TEXTS, tasks=1)
    (ds,) = out.glob("*.ds")
    vocab = vocabulary(str(tmp_path / "tok"), None, None, None, "")
    index = Path(f"{ds}.index")
    ends = np.fromfile(index, "<u8")
    ends[-1] += 5
    ends.tofile(index)
    with pytest.raises(
        ValueError, match=r"\.ds\.index: document ends .* do not rise to the \d+ tokens"
    ):
        convert(out, tmp_path / "p", vocab)
    meta = Path(f"{ds}.metadata")
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([lines[0], str(int(lines[1]) + 1), *lines[2:]]))
    with pytest.raises(ValueError, match=r"\.ds: \d+ bytes, but .*metadata says \d+ tokens"):
        convert(out, tmp_path / "p", vocab)


# --------------------------------------------------------------------------- HF datasets
def test_hf_datasets_save_to_disk(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"input_ids": [d.tolist() for d in DOCS], "text": [str(i) for i in range(len(DOCS))]}
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "hf"))
    m = convert(tmp_path / "hf", tmp_path / "out", VOCAB, val_fraction=0.2)
    same_documents_in_order(tmp_path / "out", DOCS)
    assert m.skipped_empty_documents == 1
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "hfdict"))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train'\]; pass --split"):
        convert(tmp_path / "hfdict", tmp_path / "o2", VOCAB)
    convert(tmp_path / "hfdict", tmp_path / "o2", VOCAB, split="train", val_fraction=0.2)
    assert all_documents(tmp_path / "o2") == all_documents(tmp_path / "out")
    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "notok"))
    with pytest.raises(ValueError, match=r"has columns \['text'\]; expected an 'input_ids' column"):
        convert(tmp_path / "notok", tmp_path / "o3", VOCAB)


def test_cli_and_bad_vocabulary_options(tmp_path, capsys):
    write_megatron(tmp_path / "c", [[d] for d in DOCS if len(d)])
    main(
        [
            str(tmp_path / "c.idx"),
            "--out",
            str(tmp_path / "o"),
            "--vocab-size",
            "1000",
            "--eos-id",
            "999",
        ]
    )
    assert "train: " in capsys.readouterr().out
    assert load_manifest(tmp_path / "o").tokenizer == {
        "kind": "external",
        "name": "unknown",
        "vocab_size": 1000,
    }
    with pytest.raises(
        ValueError, match="expected --tokenizer FOLDER, or both --vocab-size and --eos-id"
    ):
        vocabulary(None, 1000, None, None, "x")
    with pytest.raises(ValueError, match=r"--eos-id 1000; expected 0 <= id < --vocab-size 1000"):
        vocabulary(None, 1000, 1000, None, "x")
    with pytest.raises(ValueError, match="not a Megatron prefix"):
        convert(tmp_path / "nothing", tmp_path / "o5", VOCAB)


def test_converted_folder_trains_with_document_boundaries(tmp_path):
    """The DataModule reads a converted corpus: packed rows' segments are its documents."""
    from longctx.data import DataConfig, LongCtxDataModule

    write_megatron(tmp_path / "c", [[d] for d in DOCS if len(d)])
    convert(tmp_path / "c", tmp_path / "out", VOCAB, val_fraction=0.2)
    config = DataConfig(
        shards=[str(tmp_path / "out")],
        seq_len=64,
        micro_batch_size=1,
        packer="concat_chunk",
        val_rows=1,
    )
    dm = LongCtxDataModule(config)
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    lengths = {len(d) for d in DOCS if len(d)}
    segments = batch.seq_lens[batch.seq_lens > 0].tolist()
    interior = segments[1:-1]  # the first and last segment of a row may be cut pieces
    assert interior and all(s in lengths for s in interior), (segments, sorted(lengths))
