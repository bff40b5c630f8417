"""Any local transformers causal LM folder, scored with plain transformers (nothing downloaded).

Every instance is one document in its own row, so the model's own attention (sdpa or eager,
causal) is exactly what is wanted: no packing, no longctx attention. The scorer exposes the
decoder's final hidden states and the lm head (with the family's logit scale), so teacher-forced
logits are computed at the answer positions only (argmax is what is scored: a final-logit
soft-cap, being monotone, cannot change it), and generation is transformers' own greedy
``generate`` (``do_sample=False``, ``max_new_tokens`` = the task's tokens_to_generate).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from longctx.batch import PackedBatch
from longctx.eval.ruler.instances import RulerInputError
from longctx.model.interface import PackedCausalLM


class HFScorer(PackedCausalLM):
    """A transformers ``*ForCausalLM`` over PackedBatch rows of one document each (scoring only:
    no loss, no FLOPs)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        head = hf_model.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise RulerInputError(
                f"--hf model {type(hf_model).__name__} has no bias-free lm head; expected a "
                "causal LM whose logits are hidden states x the lm head's weight"
            )
        self.hf_model = hf_model

    @property
    def output_weight(self) -> Tensor:
        from longctx.hf.adapter import logit_scale

        weight = self.hf_model.get_output_embeddings().weight
        scale = logit_scale(self.hf_model.config)
        return weight if scale == 1.0 else weight * scale

    def hidden_states(self, batch: PackedBatch) -> Tensor:
        _check_one_document(batch)
        out = self.hf_model.get_decoder()(
            input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False
        )
        return out.last_hidden_state

    @torch.no_grad()
    def generate_from_batch(self, batch: PackedBatch, max_new_tokens: int) -> list[list[int]]:
        """transformers' own greedy ``generate`` (no sampling, one beam) of ``max_new_tokens``
        after each row's prompt, stopping at the model's EOS as transformers does; the new ids."""
        from longctx.hf.adapter import greedy_continuations

        _check_one_document(batch)
        return greedy_continuations(self.hf_model, batch.tokens, max_new_tokens)


def _check_one_document(batch: PackedBatch) -> None:
    if (batch.seq_lens[:, 1:] != 0).any():
        raise ValueError("HFScorer scores rows of one document each (no packed segments)")


def load_hf_folder(folder: str | Path, device: str = "cpu", dtype: str = "float32"):
    """(HFScorer, tokenizer, max positions or None) of a local transformers folder."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from longctx.data.tokenizer import HFTokenizer
    from longctx.dtypes import dtype_named
    from longctx.hf.folders import LOCAL_ONLY, check_no_remote_code
    from longctx.train.init_from import check_finite_weights

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise RulerInputError(
            f"--hf folder has no config.json ({folder}); expected a transformers model folder "
            "(save_pretrained, or python -m longctx.hf.export)"
        )
    check_no_remote_code(folder)  # before transformers reads anything of it
    raw = json.loads((folder / "config.json").read_text())
    name = f"{', '.join(raw.get('architectures') or ['?'])} (model_type={raw.get('model_type')!r})"
    try:
        config = AutoConfig.from_pretrained(folder, **LOCAL_ONLY)
    except (ValueError, KeyError) as err:
        raise RulerInputError(
            f"--hf architecture cannot be scored ({name}): this transformers does not know it "
            f"({err}); expected a causal LM folder"
        ) from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise RulerInputError(
            f"--hf architecture cannot be scored ({name}): transformers has no causal LM for it; "
            "expected a *ForCausalLM folder"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype_named(dtype), **LOCAL_ONLY)
    check_finite_weights(model, f"--hf folder {folder}")  # never scored as a model
    tokenizer = HFTokenizer(folder)
    max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return HFScorer(model).to(device).eval(), tokenizer, max_positions


@torch.no_grad()
def hf_answer_logits(scorer: HFScorer, batch: PackedBatch) -> Tensor:
    """The logits plain transformers computes, at the labelled positions (for tests)."""
    logits = scorer.hf_model(
        input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False
    ).logits
    return logits[batch.labels != -100]
