"""Scoring the suite: one row per instance, and the report of the rows.

Two modes, every row labelled with the one it ran (``scoring``): ``generate`` (RULER's way:
greedy generation scored with the task's RULER metric) and ``teacher_forced`` (one forward pass:
correct when the argmax is right on every answer token, a stricter lower bound of RULER's
metric, never the reverse). docs/effective-length.md says more.

Tables: longctx.eval.ruler.tables; effective lengths: longctx.eval.ruler.effective_length.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.context_shard import ContextShard, gather_row
from longctx.eval.ruler.effective_length import effective_lengths
from longctx.eval.ruler.instances import Instance, RulerInputError
from longctx.eval.ruler.metrics import ruler_metric
from longctx.eval.ruler.tables import cell_table, distance_table, length_table, suite_table
from longctx.model.generate import generate_from_batch

GENERATE, TEACHER_FORCED = "generate", "teacher_forced"
SCORING_MODES = (GENERATE, TEACHER_FORCED)


def check_mode(mode: str) -> str:
    if mode not in SCORING_MODES:
        raise RulerInputError(f"scoring={mode!r}; expected one of {', '.join(SCORING_MODES)}")
    return mode


def instance_batch(instances: Sequence[Instance], row_multiple: int = 1) -> PackedBatch:
    """One instance per row, teacher-forced: inputs ``tokens[:-1]`` and the answer labels; all
    instances must share a token count (see :func:`rows_batch` for ``row_multiple``)."""
    sizes = {len(p.tokens) for p in instances}
    if len(sizes) != 1:
        raise ValueError(f"a batch needs instances of one token count, got {sorted(sizes)}")
    tokens = torch.from_numpy(np.stack([p.tokens[:-1] for p in instances]))
    labels = torch.from_numpy(np.stack([p.labels() for p in instances]))
    return rows_batch(tokens, labels, row_multiple)


def prompt_batch(instances: Sequence[Instance], row_multiple: int = 1) -> PackedBatch:
    """The instances' prompts, one per row; they must share a length."""
    lengths = {len(p.prompt) for p in instances}
    if len(lengths) != 1:
        raise ValueError(f"a batch needs prompts of one length, got lengths {sorted(lengths)}")
    tokens = torch.from_numpy(np.stack([np.asarray(p.prompt, dtype=np.int64) for p in instances]))
    return rows_batch(tokens, None, row_multiple)


def rows_batch(tokens_BN: Tensor, labels_BN: Tensor | None, row_multiple: int) -> PackedBatch:
    """Each row one document at positions 0 .. N-1; with ``row_multiple`` > 1 (a context-
    parallel split needs rows of a multiple of its chunks) a pad segment goes FIRST, so the
    document is still the row's last segment (the one generation continues). Attention never
    crosses segments, so the pad changes no result."""
    b, n = tokens_BN.shape
    pad = -n % row_multiple
    if pad == 0:
        return PackedBatch.from_lengths(tokens_BN, [[n]] * b, True, labels_BN)
    tokens = torch.cat([tokens_BN.new_zeros(b, pad), tokens_BN], 1)
    labels = None
    if labels_BN is not None:
        labels = torch.cat([labels_BN.new_full((b, pad), IGNORE_INDEX), labels_BN], 1)
    return PackedBatch.from_lengths(tokens, [[pad, n]] * b, True, labels)


def answer_logits(model, batch: PackedBatch) -> Tensor:
    """Logits [num_labelled_tokens, V] at the labelled positions, in row-major order: the
    model's ``labelled_logits`` (longctx's models, the --hf scorer: no [B, L, V] tensor at long
    L), else its forward(batch) logits."""
    if hasattr(model, "labelled_logits"):
        return model.labelled_logits(batch)
    return model(batch)[batch.labels != IGNORE_INDEX]


def answer_predictions(model, batch: PackedBatch, shard=None) -> Tensor:
    """The argmax token at every labelled position of ``batch`` (row-major), run on this rank's
    ``shard(batch)`` under context parallelism and gathered from the group."""
    local = batch if shard is None else shard(batch)
    if not isinstance(local, ContextShard):
        return answer_logits(model, local).argmax(-1)
    local_mask = local.labels != IGNORE_INDEX
    predicted = torch.full_like(local.labels, -1)
    predicted[local_mask] = answer_logits(model, local).argmax(-1)
    return gather_row(predicted, local)[batch.labels != IGNORE_INDEX]


def generate_texts(
    model, instances: Sequence[Instance], tokenizer, device, shard=None, row_multiple: int = 1
) -> list[str]:
    """Each instance's greedy continuation of its prompt (its tokens_to_generate tokens, up to
    the first EOS), decoded. The instances share a prompt length and tokens_to_generate. A
    model with its own ``generate_from_batch`` (a transformers folder) generates with it."""
    max_new = max(p.tokens_to_generate for p in instances)
    batch = prompt_batch(instances, row_multiple).to(device)
    own = getattr(model, "generate_from_batch", None)
    if own is not None:
        rows = own(batch, max_new)
    else:  # every step is taken, EOS or not: ranks that share the model stay in step
        rows = generate_from_batch(model, batch if shard is None else shard(batch), max_new)
    eos = getattr(tokenizer, "eos_id", None)
    return [
        tokenizer.decode(_until(ids[: p.tokens_to_generate], eos))
        for p, ids in zip(instances, rows, strict=True)
    ]


def _until(ids: list[int], stop: int | None) -> list[int]:
    return ids[: ids.index(stop)] if stop is not None and stop in ids else ids


@torch.no_grad()
def score_instances(
    model,
    instances: Sequence[Instance],
    batch_size: int = 4,
    device: str | torch.device = "cpu",
    forward_context=None,
    *,
    scoring: str = TEACHER_FORCED,
    tokenizer=None,
    shard: Callable[[PackedBatch], PackedBatch] | None = None,
    row_multiple: int = 1,
) -> list[dict]:
    """One row per instance, in the order of ``instances`` (see :func:`result_row`).

    scoring: ``teacher_forced`` (``score`` = the teacher-forced exact match) or ``generate``
    (``score`` = RULER's metric of the greedy generation; needs ``tokenizer`` to decode it).
    forward_context: a context manager factory every forward runs under (the trainer's
    precision). shard: under context parallelism, this rank's share of a batch (the training
    step's ``LongCtxModule.rank_shard``); every rank of the group calls with the same instances,
    and ``row_multiple`` is what the split needs the rows' length to be a multiple of.
    """
    check_mode(scoring)
    if scoring == GENERATE and tokenizer is None:
        raise RulerInputError("scoring='generate' decodes what the model writes: pass tokenizer")
    context = forward_context or contextlib.nullcontext
    rows: list[dict | None] = [None] * len(instances)
    for indices in batches(instances, batch_size, key=lambda p: len(p.tokens)):
        group = [instances[i] for i in indices]
        batch = instance_batch(group, row_multiple).to(device)
        with context():
            predicted = answer_predictions(model, batch, shard).cpu()
        targets = batch.labels[batch.labels != IGNORE_INDEX].cpu()
        hits = (predicted == targets).split([p.reference_len + p.answer_len for p in group])
        for i, hit in zip(indices, hits, strict=True):
            rows[i] = result_row(instances[i], hit)
    if scoring == GENERATE:
        for indices in batches(instances, batch_size, key=_generation_key):
            group = [instances[i] for i in indices]
            with context():
                texts = generate_texts(model, group, tokenizer, device, shard, row_multiple)
            for i, text in zip(indices, texts, strict=True):
                rows[i].update(generated_fields(instances[i], text))
    return rows


def _generation_key(p: Instance) -> tuple[int, int]:
    return len(p.prompt), p.tokens_to_generate


def batches(instances: Sequence[Instance], batch_size: int, key) -> list[list[int]]:
    """Indices of the instances in batches of up to ``batch_size`` that share ``key(instance)``,
    each group in input order, groups in order of first appearance."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RulerInputError(f"batch_size={batch_size!r}; expected an int >= 1")
    groups: dict = {}
    for i, p in enumerate(instances):
        groups.setdefault(key(p), []).append(i)
    return [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]


def result_row(instance: Instance, hit: Tensor) -> dict:
    """The teacher-forced row. ``hit``: the reference's hits (if any), then the answer's."""
    reference, answer = hit[: instance.reference_len], hit[instance.reference_len :]
    correct = bool(answer.all())
    return {
        "task": instance.task,
        "length": instance.length,
        "depth": instance.depth,
        "sample": instance.sample,
        "scoring": TEACHER_FORCED,
        "score": float(correct),
        "correct_teacher_forced": correct,
        "token_accuracy": float(answer.float().mean()),
        "answer": instance.answer,
        "prediction": None,
        "references": json.dumps(list(instance.references)),
        "distance": instance.distance,
        "reference_token_accuracy": float(reference.float().mean()) if len(reference) else None,
    }


def generated_fields(instance: Instance, prediction: str) -> dict:
    """What generation adds to the row: the text, and RULER's metric of it as the score."""
    score = ruler_metric(instance.metric, prediction, instance.references)
    return {"scoring": GENERATE, "prediction": prediction, "score": score}


def summarize(results: Sequence[dict], anchor: int | None = None) -> dict:
    """The whole report of one scoring: cells, per-length rows, the copy curve, effective
    lengths (RULER's; the relative one when ``anchor``, the training length, is given)."""
    return {
        "scoring": sorted({r["scoring"] for r in results}),
        "cells": cell_table(results),
        "lengths": length_table(results),
        "suite": suite_table(results),
        "copy_curve": distance_table(results),
        "effective_length": effective_lengths(results, anchor),
    }
