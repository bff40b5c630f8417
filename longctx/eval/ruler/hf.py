"""Any local transformers causal LM folder, scored with plain transformers (nothing downloaded).

Every instance is one document in its own row, so the model's own attention (sdpa or eager,
causal) is exactly what is wanted: no packing, no longctx attention. The scorer exposes the
decoder's final hidden states and the lm head (with the family's logit scale), so teacher-forced
logits are computed at the answer positions only (argmax is what is scored: a final-logit
soft-cap, being monotone, cannot change it), and generation is transformers' own greedy
``generate`` (``do_sample=False``, ``max_new_tokens`` = the task's tokens_to_generate).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from longctx.batch import PackedBatch
from longctx.data.tokenizer import HFTokenizer
from longctx.dtypes import dtype_named
from longctx.eval.ruler.instances import RulerInputError
from longctx.hf.adapter import greedy_continuations, logit_scale
from longctx.hf.folders import CONFIG_FILE, LOCAL_ONLY, check_no_remote_code, read_config_json
from longctx.hf.weight_source import check_finite_weights
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
        _check_one_document(batch)
        return greedy_continuations(self.hf_model, batch.tokens, max_new_tokens)


def _check_one_document(batch: PackedBatch) -> None:
    if (batch.seq_lens[:, 1:] != 0).any():
        raise ValueError("HFScorer scores rows of one document each (no packed segments)")


def load_hf_folder(folder: str | Path, device: str = "cpu", dtype: str = "float32"):
    """(HFScorer, tokenizer, max positions or None) of a local transformers folder; a folder
    that cannot be scored as it stands (no config, code of its own, an unknown architecture, a
    tokenizer whose ids the model has no embedding for, weights unreadable, missing or not
    finite) is one line naming it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise RulerInputError(
            f"--hf folder has no {CONFIG_FILE} ({folder}); expected a transformers model folder "
            "(save_pretrained, or python -m longctx.hf.export)"
        )
    check_no_remote_code(folder)  # before transformers reads anything of it
    raw = read_config_json(folder)
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
    tokenizer = HFTokenizer(folder)  # before the weights: its ids must fit the vocabulary
    check_vocabulary(tokenizer, config.get_text_config(), folder)
    model = read_weights(folder, dtype)
    check_finite_weights(model, f"--hf folder {folder}")  # never scored as a model
    max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return HFScorer(model).to(device).eval(), tokenizer, max_positions


def check_vocabulary(tokenizer, config, folder: Path) -> None:
    """Every id the tokenizer can produce has a row in the model's embedding (an id past it is
    an IndexError in the middle of scoring)."""
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and tokenizer.id_bound > vocab_size:
        raise RulerInputError(
            f"--hf folder {folder}: its tokenizer has ids up to {tokenizer.id_bound - 1}, but "
            f"config.json's vocab_size is {vocab_size}; expected a tokenizer and model saved "
            "together"
        )


def read_weights(folder: Path, dtype: str):
    """The folder's causal LM with all of its weights from its files: an unreadable file, or a
    weight missing or of another shape (which transformers fills with random values), refused."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype_named(dtype),
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # named below, not a report and a bare RuntimeError
            **LOCAL_ONLY,
        )
    except (SafetensorError, OSError, RuntimeError) as err:
        detail = " ".join(str(err).split())[:300]
        raise RulerInputError(
            f"--hf folder {folder}: its weights cannot be read ({type(err).__name__}: {detail}); "
            "expected complete weight files as save_pretrained writes them"
        ) from None
    absent = sorted(info.get("missing_keys") or []) + sorted(
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or []
    )
    if absent:
        raise RulerInputError(
            f"--hf folder {folder}: its weight files lack or misshape {len(absent)} of the "
            f"model's tensors ({', '.join(absent[:3])}); expected every weight, at config.json's "
            "shapes (transformers would fill them with random values)"
        )
    return model
