"""Run folders for the export tests: a checkpoint of a small random Llama with the run record
train.py stores in it (the resolved model and data config), in the layouts train.py writes (a
.ckpt file, or a sharded folder with its meta.pt)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import CACHE_DIR, compose
from hydra.utils import instantiate

from longctx.model import Llama
from longctx.runs.record import CHECKPOINT_KEY, RunRecord
from longctx.train.app import recorded_config

# tests/module_fixtures.SMALL with room for the byte tokenizer's 259 ids
SHAPES = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300)
YARN = "{type: yarn, factor: 4, original_max_position: 32}"


def model_overrides(rope_scaling: str | None = YARN, **shapes) -> list[str]:
    fields = {**SHAPES, **shapes, "attn_backend": "sdpa"}
    scaling = [f"model.rope_scaling={rope_scaling}"] if rope_scaling else []
    return ["model=tiny", *(f"++model.{k}={v}" for k, v in fields.items()), *scaling]


def make_run(
    root: Path,
    overrides: list[str] | None = None,
    seq_len: int = 64,
    seed: int = 5,
    sharded: bool = False,
) -> Path:
    """root/run/checkpoints/last.ckpt (a folder when ``sharded``) with its run record."""
    run = root / "run"
    cfg = compose(
        (overrides or model_overrides())
        + [f"data.seq_len={seq_len}", f"paths.cache_dir={CACHE_DIR}"],
        output_dir=run,
    )
    torch.manual_seed(seed)
    model = Llama(instantiate(cfg.model))
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    record = {CHECKPOINT_KEY: RunRecord({}, recorded_config(cfg)).record}
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    if sharded:  # the layout Lightning's FSDP2 strategy writes: tensors by DCP, the rest meta.pt
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(ckpt))
        torch.save(record, ckpt / "meta.pt")
    else:
        torch.save({**state, **record}, ckpt)
    return run


def longctx_model(run: Path) -> Llama:
    """longctx's Llama as the run's record and last checkpoint give it."""
    from longctx.hf.config_targets import CONFIG_TARGETS
    from longctx.hf.run_model import llama_config, read_model
    from longctx.runs.record import read_stored_run

    stored = read_stored_run(run, CONFIG_TARGETS)
    return read_model(stored.checkpoint, llama_config(stored))


USER_SPECIALS = ["<pad>", "<s>", "</s>"]
TRAINING_TEXT = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "Ünïcödé and 長い文脈 🙂, tabs\tand  spaces.",
] * 20


def make_user_tokenizer(folder: Path, vocab_size: int = 280) -> Path:
    """A user's own HF tokenizer, built locally: a byte-level BPE with <pad> <s> </s>, and a
    post-processor that adds <s> in front (as Llama's does), which prepare never applies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=USER_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def make_user_run(root: Path, source: Path, overrides: list[str] | None = None) -> Path:
    """A run (see :func:`make_run`) whose data was prepared with the user's tokenizer folder
    ``source``: the export carries the data's tokenizer."""
    from longctx.data.prepare import prepare

    root.mkdir(parents=True, exist_ok=True)
    jsonl = root / "text.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TRAINING_TEXT))
    data = root / "user-data"
    prepare([jsonl], data, source, workers=1, val_fraction=0.1, progress=False)
    return make_run(root, [*(overrides or model_overrides()), f"data.shards=[{data}]"])
