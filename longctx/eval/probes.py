"""Long-range retrieval probe: a passkey hidden at a depth in filler text, asked for at the end.

A probe of context length ``n`` is ``n`` input tokens: filler, with the needle ("The pass key is
48213. Remember it.") inserted at ``depth`` (0 = the start of the context, 1 = right before the
question), then the question ("What is the pass key? The pass key is") and the answer digits.
The answer is teacher-forced: the model is scored on its argmax prediction of every answer token
given everything before it, so no generation loop is needed. A probe is correct when every answer
token is predicted right.

Everything is generated from the tokenizer and a seed (no downloads): the filler is sentences drawn
from a small fixed vocabulary, so the same seed gives the same probes on every machine.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_SUBJECTS = ("The river", "A lamp", "The old road", "Every garden", "The wind", "A small boat")
_VERBS = ("runs past", "shines over", "waits beside", "turns toward", "rests under", "follows")
_OBJECTS = ("the hills", "a quiet town", "the grey stones", "the long field", "an open door")
_TAILS = ("in the morning", "at night", "without a sound", "as it always has", "once again")


@dataclasses.dataclass(frozen=True)
class PasskeyProbe:
    """One probe: ``tokens`` [n + 1] is the whole text; inputs are tokens[:-1]; the answer is the
    last ``answer_len`` tokens."""

    length: int
    depth: float
    sample: int
    passkey: str
    tokens: np.ndarray
    answer_len: int

    def labels(self) -> np.ndarray:
        """int64 [n]: the answer tokens at the positions that predict them, -100 elsewhere."""
        labels = np.full(self.length, IGNORE_INDEX, dtype=np.int64)
        labels[-self.answer_len :] = self.tokens[-self.answer_len :]
        return labels


def filler_text(rng: random.Random, min_chars: int) -> str:
    """Deterministic sentences from a fixed vocabulary, at least min_chars characters."""
    parts, size = [], 0
    while size < min_chars:
        words = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS))
        sentence = " ".join(words) + " " + rng.choice(_TAILS) + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def make_probe(
    tokenizer, length: int, depth: float, seed: int, sample: int = 0, digits: int = 5
) -> PasskeyProbe:
    """One passkey probe of ``length`` input tokens with the needle at ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}; expected a fraction in [0, 1]")
    if digits < 1:
        raise ValueError(f"digits={digits}; expected >= 1")
    rng = random.Random(f"passkey/{seed}/{length}/{depth}/{sample}")
    passkey = "".join(rng.choice("0123456789") for _ in range(digits))
    needle = _encode(tokenizer, f" The pass key is {passkey}. Remember it. ")
    question = _encode(tokenizer, " What is the pass key? The pass key is")
    answer = _encode(tokenizer, f" {passkey}")
    n_filler = length + 1 - len(needle) - len(question) - len(answer)
    if n_filler < 0:
        raise ValueError(
            f"probe length={length} is too short: needle, question and answer alone take "
            f"{length + 1 - n_filler} tokens"
        )
    filler = _filler_tokens(tokenizer, rng, n_filler)
    cut = round(depth * n_filler)
    tokens = np.concatenate([filler[:cut], needle, filler[cut:], question, answer])
    return PasskeyProbe(length, depth, sample, passkey, tokens, len(answer))


def _filler_tokens(tokenizer, rng: random.Random, count: int) -> np.ndarray:
    chars = max(64, count)
    while True:
        ids = _encode(tokenizer, filler_text(rng, chars))
        if len(ids) >= count:
            return ids[:count]
        chars *= 2


def make_probes(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 4,
    seed: int = 0,
    digits: int = 5,
) -> list[PasskeyProbe]:
    """Every (length, depth, sample) probe, in that order; deterministic given the seed."""
    if samples < 1:
        raise ValueError(f"samples={samples}; expected >= 1")
    return [
        make_probe(tokenizer, n, d, seed, s, digits)
        for n in lengths
        for d in depths
        for s in range(samples)
    ]


def default_lengths(max_len: int, min_len: int = 1024) -> list[int]:
    """Powers of two from min(min_len, max_len) up to max_len, plus max_len itself."""
    if max_len < 1:
        raise ValueError(f"max_len={max_len}; expected >= 1")
    out, n = [], min(min_len, max_len)
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def probe_batch(probes: Sequence[PasskeyProbe], reset_position_ids: bool = True) -> PackedBatch:
    """One probe per row (one segment each); all probes must share a length."""
    lengths = {p.length for p in probes}
    if len(lengths) != 1:
        raise ValueError(f"probe_batch needs probes of one length, got lengths {sorted(lengths)}")
    n = lengths.pop()
    tokens = torch.from_numpy(np.stack([p.tokens[:-1] for p in probes]))
    labels = torch.from_numpy(np.stack([p.labels() for p in probes]))
    seq_lens = [[n]] * len(probes)
    return PackedBatch.from_lengths(tokens, seq_lens, reset_position_ids, labels=labels)


def answer_logits(model, batch: PackedBatch) -> Tensor:
    """Logits [num_answer_tokens, V] at the labelled positions, in row-major order.

    Uses the model's hidden states and output weight when it has them (no [B, L, V] tensor at
    long L), else its forward(batch) logits.
    """
    mask = batch.labels != IGNORE_INDEX
    if hasattr(model, "hidden_states") and hasattr(model, "output_weight"):
        h = model.hidden_states(batch)[mask]
        return torch.nn.functional.linear(h, model.output_weight)
    return model(batch)[mask]


@torch.no_grad()
def score_probes(
    model, probes: Sequence[PasskeyProbe], batch_size: int = 4, device: str | torch.device = "cpu"
) -> list[dict]:
    """Per probe: length, depth, sample, passkey, correct (all answer tokens), token_accuracy."""
    results = []
    for group in _batches_by_length(probes, batch_size):
        batch = probe_batch(group).to(device)
        predicted = answer_logits(model, batch).argmax(dim=-1).cpu()
        targets = batch.labels[batch.labels != IGNORE_INDEX].cpu()
        hits = (predicted == targets).split([p.answer_len for p in group])
        for probe, hit in zip(group, hits, strict=True):
            results.append(_result(probe, hit))
    return results


def _batches_by_length(
    probes: Sequence[PasskeyProbe], batch_size: int
) -> Iterable[list[PasskeyProbe]]:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; expected >= 1")
    by_length: dict[int, list[PasskeyProbe]] = {}
    for p in probes:
        by_length.setdefault(p.length, []).append(p)
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def _result(probe: PasskeyProbe, hit: Tensor) -> dict:
    return {
        "length": probe.length,
        "depth": probe.depth,
        "sample": probe.sample,
        "passkey": probe.passkey,
        "correct": bool(hit.all()),
        "token_accuracy": float(hit.float().mean()),
    }


def accuracy_table(results: Sequence[dict]) -> list[dict]:
    """Mean accuracy per (length, depth): the needle heat map as rows."""
    cells: dict[tuple[int, float], list[dict]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r)
    return [
        {
            "length": n,
            "depth": d,
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "token_accuracy": sum(r["token_accuracy"] for r in rs) / len(rs),
            "samples": len(rs),
        }
        for (n, d), rs in sorted(cells.items())
    ]
