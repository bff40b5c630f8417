"""Honest lengths for every RoPE type longctx trains with: config.json passes transformers' own
validation without a warning, max_position_embeddings follows the stated rule
(longctx.hf.lengths), the tokenizer's model_max_length equals it, generation_config.json has
the special ids, and transformers' logits equal longctx's up to that length."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from export_helpers import longctx_model, make_run, model_overrides

from longctx.batch import PackedBatch
from longctx.hf.export import export

# (rope_scaling, data.seq_len, extra overrides, expected max_position_embeddings)
CASES = {
    "none": (None, 64, [], 64),
    "linear": ("{type: linear, factor: 4}", 64, [], 64),  # states no reach: the trained length
    "yarn": ("{type: yarn, factor: 4, original_max_position: 32}", 64, [], 128),
    "llama3": ("{type: llama3, factor: 8, original_max_position: 16}", 64, [], 128),
    "yarn_trained_beyond": ("{type: yarn, factor: 2, original_max_position: 16}", 64, [], 64),
    "stages": (None, 64, ["data.stages=[{until_step: 5, seq_len: 96, micro_batch_size: 1}]"], 96),
}


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("case", list(CASES))
def test_lengths_and_config_validation_per_rope_type(tmp_path, case):
    scaling, seq_len, extra, expected = CASES[case]
    run = make_run(tmp_path, model_overrides(scaling) + extra, seq_len=seq_len)
    out = export(run, tmp_path / "hf").folder
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == expected
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == expected
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (
        257,
        258,
        256,
    )

    caught = _Warnings()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(caught)
    try:
        theirs = transformers.LlamaConfig(**config)
        theirs.validate_rope()  # transformers' own check of the rope dict against the lengths
    finally:
        hf_logger.removeHandler(caught)
    if case == "yarn_trained_beyond":  # the rule keeps the trained 64 over YaRN's reach of 32:
        assert any("implicit factor" in m for m in caught.messages)  # transformers says so
    else:
        assert caught.messages == []
    assert theirs.max_position_embeddings == expected
    kind = (theirs.rope_parameters or {}).get("rope_type", "default")
    assert kind == ("default" if scaling is None else case.split("_")[0])

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 259, (1, expected), generator=torch.Generator().manual_seed(0))
    batch = PackedBatch.from_lengths(tokens, [[expected]], reset_position_ids=True)
    ours = longctx_model(run)
    with torch.no_grad():  # up to the last position the export states
        want = model(input_ids=tokens, position_ids=batch.position_ids).logits
        torch.testing.assert_close(ours(batch), want, rtol=0, atol=1e-5 * float(want.abs().max()))
