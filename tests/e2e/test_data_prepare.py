"""prepare() -> shards -> ShardSet: contents, formats, dtypes, crash safety, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from longctx.data.prepare import PrepareTaskFailed, prepare
from longctx.data.shards import (
    MANIFEST_NAME,
    ManifestError,
    ShardSet,
    load_manifest,
)
from longctx.data.sources import is_validation
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from longctx.io import TEMP_PREFIX

TEXTS = [f"document {i}: " + "lorem ipsum dolor " * (i % 7 + 1) + "é✓" for i in range(60)]


class BigVocabTokenizer:
    """Fake tokenizer with 70000 ids: needs uint32 shards."""

    vocab_size, eos_id, pad_id = 70_000, 69_999, 0

    def encode(self, text):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) * 271

    def decode(self, ids):
        return ""

    @property
    def spec(self):
        return {"kind": "test-big", "vocab_size": self.vocab_size}


def write_jsonl(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def all_documents(folder: Path) -> list[np.ndarray]:
    """Documents of both splits, in input order (merged by their split assignment)."""
    return [
        ShardSet(folder, s).document(i)
        for s in ("train", "val")
        for i in range(ShardSet(folder, s).num_documents)
    ]


def expected_split(texts, sha, tok, val_fraction):
    out = {"train": [], "val": []}
    for line_no, text in enumerate(texts, 1):
        split = "val" if is_validation(f"{sha[:16]}:{line_no}", val_fraction) else "train"
        out[split].append(np.append(tok.encode(text), tok.eos_id))
    return out


def test_jsonl_roundtrip_tokens_counts_and_split(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    m = prepare(
        [src],
        tmp_path / "out",
        "byte",
        workers=2,
        val_fraction=0.2,
        shard_tokens=500,
        progress=False,
    )
    want = expected_split(TEXTS, m.sources[0]["sha256"], ByteTokenizer(), 0.2)
    assert 0 < len(want["val"]) < len(TEXTS)
    for split in ("train", "val"):
        got = ShardSet(tmp_path / "out", split)
        assert got.num_documents == m.splits[split].documents == len(want[split])
        assert got.num_tokens == m.splits[split].tokens == sum(map(len, want[split]))
        for i, doc in enumerate(want[split]):
            np.testing.assert_array_equal(got.document(i), doc)
    assert len(m.splits["train"].shards) > 1  # shard_tokens=500 forces several shards
    assert m.dtype == "uint16" and m.eos_id == ByteTokenizer.EOS
    assert ByteTokenizer().decode(ShardSet(tmp_path / "out").document(0)) in TEXTS


def test_uint32_for_large_vocab(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS[:5])
    m = prepare(
        [src], tmp_path / "out", BigVocabTokenizer(), workers=1, val_fraction=0.0, progress=False
    )
    assert m.dtype == "uint32"
    got = ShardSet(tmp_path / "out").document(0)
    np.testing.assert_array_equal(got, np.append(BigVocabTokenizer().encode(TEXTS[0]), 69_999))


def test_text_glob_and_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, text in enumerate(TEXTS[:4]):
        (tmp_path / f"f{i}.txt").write_text(text)
    pq.write_table(
        pa.table({"text": TEXTS[4:9], "id": [f"p{i}" for i in range(5)]}), tmp_path / "d.parquet"
    )
    m = prepare(
        [str(tmp_path / "*.txt"), tmp_path / "d.parquet"],
        tmp_path / "out",
        "byte",
        workers=1,
        val_fraction=0.0,
        progress=False,
    )
    assert m.splits["train"].documents == 9
    got = {ByteTokenizer().decode(d[:-1]) for d in all_documents(tmp_path / "out")}
    assert got == set(TEXTS[:9])
    assert [Path(s["path"]).name for s in m.sources] == ["d.parquet"] + [
        f"f{i}.txt" for i in range(4)
    ]


def test_hf_tokenizer_from_local_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<pad>": 1, "</s>": 2, "lorem": 3, "ipsum": 4, "dolor": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>"})
    )
    hf = load_tokenizer(str(folder))
    assert isinstance(hf, HFTokenizer) and (hf.vocab_size, hf.eos_id, hf.pad_id) == (6, 2, 1)
    src = write_jsonl(tmp_path / "d.jsonl", ["lorem ipsum", "dolor x lorem"])
    m = prepare([src], tmp_path / "out", str(folder), workers=2, val_fraction=0.0, progress=False)
    assert m.tokenizer["kind"] == "hf" and m.vocab_size == 6
    docs = all_documents(tmp_path / "out")
    assert [d.tolist() for d in docs] == [[3, 4, 2], [5, 0, 3, 2]]


def test_rerun_is_noop_and_changed_inputs_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    prepare([src], out, "byte", workers=1, val_fraction=0.1, progress=False)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    time.sleep(0.01)
    prepare([src], out, "byte", workers=2, val_fraction=0.1, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    write_jsonl(src, TEXTS[:10])
    with pytest.raises(FileExistsError, match="other inputs"):
        prepare([src], out, "byte", workers=1, val_fraction=0.1, progress=False)
    # 10 documents draw no validation split at 0.1 (refused): none asked for
    prepare([src], out, "byte", workers=1, val_fraction=0.0, overwrite=True, progress=False)
    assert (
        load_manifest(out).splits["train"].documents + load_manifest(out).splits["val"].documents
        == 10
    )


_SLOW_PREPARE = """
import sys, time
import numpy as np
from longctx.data.prepare import PrepareTaskFailed, prepare
from longctx.data.tokenizer import ByteTokenizer

class SlowByte(ByteTokenizer):
    def encode(self, text):
        time.sleep(0.01)
        return super().encode(text)

    @property
    def spec(self):
        return ByteTokenizer().spec  # same spec: the rerun must match the manifest hash

prepare([sys.argv[1]], sys.argv[2], SlowByte(), workers=1, val_fraction=0.1,
        shard_tokens=300, progress=False)
"""


def test_interrupted_prepare_then_rerun_equals_uninterrupted(tmp_path):
    texts = [t * 3 for t in TEXTS] * 10  # 600 docs at 10 ms: about 6 s uninterrupted
    src = write_jsonl(tmp_path / "d.jsonl", texts)
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SLOW_PREPARE), str(src), str(out)],
        start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while len(list(out.glob("train-00000-0000[3-9].tokens.npy"))) == 0:
            assert proc.poll() is None and time.time() < deadline, "prepare ended too soon"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / MANIFEST_NAME).exists()  # no commit point: readers refuse the folder
    with pytest.raises(FileNotFoundError, match="manifest"):
        ShardSet(out)
    prepare([src], out, "byte", workers=1, val_fraction=0.1, shard_tokens=300, progress=False)
    clean = tmp_path / "clean"
    prepare([src], clean, "byte", workers=1, val_fraction=0.1, shard_tokens=300, progress=False)
    listed = load_manifest(clean)
    assert load_manifest(out) == listed
    for split in listed.splits.values():
        for shard in split.shards:
            for name in (shard.tokens_file, shard.index_file):
                assert (out / name).read_bytes() == (clean / name).read_bytes()
    assert not list(out.glob(f"{TEMP_PREFIX}*"))


def test_bad_inputs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        prepare([tmp_path / "nope*.txt"], tmp_path / "out", progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare([empty], tmp_path / "out", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(PrepareTaskFailed, match="bad.jsonl:1 has no string 'text'"):
        prepare([tmp_path / "bad.jsonl"], tmp_path / "out2", workers=1, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))


def test_reader_rejects_missing_resized_and_out_of_vocab_shards(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    m = prepare([src], out, "byte", workers=1, val_fraction=0.0, progress=False)
    tokens_file = out / m.splits["train"].shards[0].tokens_file
    original = np.load(tokens_file)
    corrupt = original.copy()
    corrupt[5] = 400  # >= vocab 259, same size on disk
    np.save(tokens_file, corrupt)
    with pytest.raises(ValueError, match="token id 400 >= vocab_size 259"):
        ShardSet(out)
    np.save(tokens_file, original[:-1])
    with pytest.raises(ValueError, match="bytes, the manifest lists"):
        ShardSet(out)
    tokens_file.unlink()
    with pytest.raises(FileNotFoundError, match="is missing"):
        ShardSet(out)


# --------------------------------------------------------------------------- the user's files
def test_prepare_keeps_the_users_temp_files_and_refuses_a_foreign_folder(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS[:5])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"out is a non-empty folder that holds no prepared"):
        prepare([src], out, workers=1, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written among them
    (out / "notes.txt").unlink()
    prepare([src], out, workers=1, val_fraction=0.0, progress=False)
    user_tmp = out / ".tmp-draft.txt"  # the user's own file, with the old temp-name pattern
    user_tmp.write_text("draft")
    src.write_text(src.read_text() + json.dumps({"text": "one more"}) + "\n")
    prepare([src], out, workers=1, val_fraction=0.0, overwrite=True, progress=False)
    assert user_tmp.read_text() == "draft"
    assert load_manifest(out).splits["train"].documents == 6


# --------------------------------------------------------------------------- named errors
@pytest.mark.parametrize(
    "name, data, message",
    [
        (
            "latin1.txt",
            "café".encode("latin-1"),
            r"latin1.txt is not UTF-8 text \(invalid byte 0xe9",
        ),
        ("blob.txt", b"\x00\x01\x02binary", r"blob.txt holds NUL bytes \(offset 0\): a binary"),
        ("bad.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', r"bad.jsonl:3 is not valid JSON"),
        ("enc.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', r"enc.jsonl:2 is not UTF-8 text"),
    ],
)
def test_unreadable_input_names_file_and_line(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(PrepareTaskFailed, match=message):
        prepare([tmp_path / name], tmp_path / "out", workers=1, progress=False)


def test_jsonl_line_numbers_count_carriage_returns_as_text(tmp_path):
    """A lone \\r inside a line is not a line break for editors (nor here): line 2 is line 2."""
    (tmp_path / "cr.jsonl").write_bytes(b'{"text": "a"}\r\n{"text": "b"} \r {oops\n')
    with pytest.raises(PrepareTaskFailed, match=r"cr.jsonl:2 is not valid JSON"):
        prepare([tmp_path / "cr.jsonl"], tmp_path / "out", workers=1, progress=False)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda text: text[: len(text) // 2], r"manifest.json is not valid JSON"),
        (lambda text: text.replace('"vocab_size"', '"vocab"'), r"key 'vocab_size' is missing"),
        (
            lambda text: text.replace('"tokens_bytes"', '"bytes"', 1),
            r"key 'splits\.train\.shards\[0\]\.tokens_bytes' is missing",
        ),
        (lambda text: text.replace('"eos_id": 258', '"eos_id": "258"'), r"key eos_id = '258'"),
    ],
)
def test_damaged_manifest_names_path_and_key(tmp_path, edit, message):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS[:5])
    out = tmp_path / "out"
    prepare([src], out, workers=1, val_fraction=0.0, progress=False)
    path = out / MANIFEST_NAME
    path.write_text(edit(path.read_text()))
    with pytest.raises(ManifestError, match=message) as err:
        ShardSet(out)
    assert str(path) in str(err.value)


def test_damaged_manifest_is_not_reported_as_a_model_vocab_error(tmp_path):
    from helpers import FAST, run_train

    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "corpus"
    prepare([src], out, workers=1, val_fraction=0.1, progress=False)
    path = out / MANIFEST_NAME
    path.write_text(path.read_text().replace('"vocab_size"', '"vocab"'))
    proc = run_train(
        [*FAST, "data=shards", f"data.shards=[{out}]", "trainer.max_steps=1"], tmp_path, check=False
    )
    assert proc.returncode != 0
    assert f"{path}: key 'vocab_size' is missing" in proc.stderr, proc.stderr[-3000:]
    assert "model.vocab_size" not in proc.stderr
