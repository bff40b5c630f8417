"""The leak probe's checks: pure functions over a model and packed rows (no Hydra, no Lightning).

Given the rows a run trains on and the model as the run calls it (its backend, precision and
context-parallel split), four checks (``boundary_loss``, ``positions``, ``isolation``,
``equivalence``) say whether documents stay apart: docs/leak-probe.md.

The tolerances come from measurements, not assumptions: the repeated unperturbed forward (the
noise floor) and a perturbed token inside a document (the positive control, which must move
that document's later outputs, or the probe could not see a leak at all). All values are
relative: ``max |difference| / max |reference output|`` over the batch.

Under context parallelism every rank compares the outputs of its own tokens and the per-segment
maxima are reduced over the world, so every rank reaches the same verdict. All ranks must call
:func:`probe` with the same rows (their forwards run in lockstep).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch, position_ids_for
from longctx.context_shard import ContextShard
from longctx.errors import LongctxError
from longctx.probe.report import Report, Result

CHECKS = ("boundary_loss", "positions", "isolation", "equivalence")
TOLERANCE_NAMES = ("isolation", "equivalence")
NOISE_REPEATS = 2  # extra unperturbed forwards that measure the noise floor
NOISE_FACTOR = 4.0  # a tolerance is at least this many times the measured noise floor
CONTROL_MARGIN = 10.0  # the positive control must move this many times the isolation tolerance
# Per-dtype floors, relative to the outputs' magnitude. Isolation: one unit of the compute dtype's
# precision (a masked backend computes other documents bitwise alike: a leak moves them by whole
# units). Equivalence: a segment alone runs other matrix shapes, so its sums round in another
# order: fp32 within the project's 1e-5, half precision within 4 units.
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
ISOLATION_FLOOR = {dtype: torch.finfo(dtype).eps for dtype in FLOAT_DTYPES}
EQUIVALENCE_FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
    torch.float16: 4 * torch.finfo(torch.float16).eps,
}

UNSEEN = torch.iinfo(torch.int64).min  # a row position no shard holds
Forward = Callable[[PackedBatch], tuple[Tensor, Tensor]]  # batch -> (logits, per-token loss)


class NothingToProbe(LongctxError):
    """Rows that hold one document each: there is no other document a leak could reach."""


@dataclasses.dataclass
class ProbeRows:
    """Rows as the run builds them. ``pad_tokens[r]``: the length of row r's pad tail (the
    packer's count: neither tokens nor labels tell pad apart), 0 for none."""

    batch: PackedBatch
    pad_tokens: list[int]
    name: str = "rows"

    def __post_init__(self) -> None:
        if len(self.pad_tokens) != self.batch.shape[0]:
            raise ValueError(
                f"pad_tokens has {len(self.pad_tokens)} entries for {self.batch.shape[0]} rows"
            )

    def documents(self, row: int) -> int:
        """Document segments of a row (whole documents or fragments), the pad tail excluded."""
        return int((self.batch.seq_lens[row] > 0).sum()) - (self.pad_tokens[row] > 0)

    def segments(self, row: int) -> list[tuple[int, int]]:
        """(start, end) of every segment of a row, the pad tail included."""
        lens = [n for n in self.batch.seq_lens[row].tolist() if n > 0]
        ends = torch.tensor(lens).cumsum(0).tolist()
        return [(end - n, end) for n, end in zip(lens, ends, strict=True)]

    def to(self, device) -> ProbeRows:
        return dataclasses.replace(self, batch=self.batch.to(device))

    def is_pad(self, row: int, segment: int) -> bool:
        return self.pad_tokens[row] > 0 and segment == len(self.segments(row)) - 1


@dataclasses.dataclass
class Target:
    """The model as the run calls it. ``shard`` turns a batch of whole rows into what the model
    gets (a rank's ContextShard under context parallelism); ``context`` is the run's precision
    (autocast) context; ``vocab_size`` bounds the perturbed token ids (the data's vocabulary)."""

    forward: Forward
    vocab_size: int
    reset_position_ids: bool
    shard: Callable[[PackedBatch], PackedBatch] = lambda batch: batch
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def packed_lm_forward(model) -> Forward:
    """Logits from a longctx PackedCausalLM's forward (under FSDP2 its hooks gather the
    parameters around it) and each token's fp32 cross-entropy of those logits, as the model's
    chunked loss computes it."""

    def forward(batch: PackedBatch) -> tuple[Tensor, Tensor]:
        logits_BLV = model(batch)
        loss_N = F.cross_entropy(
            logits_BLV.flatten(0, 1).float(),
            batch.labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        return logits_BLV, loss_N.view(batch.shape)

    return forward


def check_checks(names: Sequence[str] | None) -> tuple[str, ...]:
    """The checks to run (all for None); an unknown name is refused."""
    if names is None:
        return CHECKS
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise LongctxError(
            f"unknown check name ({', '.join(unknown) or 'none given'}); "
            f"choose from {', '.join(CHECKS)}"
        )
    return tuple(dict.fromkeys(names))


def check_tolerances(tolerances: Mapping[str, float] | None) -> dict[str, float]:
    """Relative tolerance overrides by check name, each finite and positive."""
    out = {}
    for name, value in (tolerances or {}).items():
        if name not in TOLERANCE_NAMES:
            raise LongctxError(
                f"unknown check name in a tolerance ({name}); tolerances are set for "
                f"{', '.join(TOLERANCE_NAMES)}"
            )
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            raise LongctxError(
                f"tolerance {name}={value!r} is not a finite positive number; pass one "
                f"relative to the outputs' magnitude, e.g. {name}=1e-5"
            )
        out[name] = number
    return out


def check_probeable(rows: Sequence[ProbeRows]) -> None:
    """Refuse rows among which none holds two documents: no leak could show."""
    most = max(rows_.documents(r) for rows_ in rows for r in range(rows_.batch.shape[0]))
    if most < 2:
        shapes = ", ".join(f"{rows_.name}: {tuple(rows_.batch.shape)}" for rows_ in rows)
        raise NothingToProbe(
            f"nothing to probe: every row holds one document ({shapes}); pack several documents "
            "per row (a longer data.seq_len, or a corpus of shorter documents)"
        )


def probe(
    target: Target,
    rows: Sequence[ProbeRows],
    checks: Sequence[str] | None = None,
    tolerances: Mapping[str, float] | None = None,
    seed: int = 0,
) -> Report:
    """Run ``checks`` (all by default) on every batch of ``rows``; results in order."""
    checks = check_checks(checks)
    tolerances = check_tolerances(tolerances)
    check_probeable(rows)
    results: list[Result] = []
    for probed in rows:
        results += _probe_rows(target, probed, checks, tolerances, seed)
    return Report(results)


def _probe_rows(target, probed: ProbeRows, checks, tolerances, seed) -> list[Result]:
    results = []
    seen = target.shard(probed.batch)
    if "boundary_loss" in checks:
        results += boundary_loss(probed, seen)
    if "positions" in checks:
        results.append(positions(probed, seen, target.reset_position_ids))
    if "isolation" in checks or "equivalence" in checks:
        ref, noise = _reference(target, probed.batch)
        results += noise.results(probed.name)
        if "isolation" in checks:
            results += isolation(target, probed, ref, noise, tolerances.get("isolation"), seed)
        if "equivalence" in checks:
            results += equivalence(target, probed, ref, noise, tolerances.get("equivalence"))
    return results


def boundary_loss(probed: ProbeRows, seen: PackedBatch) -> list[Result]:
    """Targets the model gets at a segment end followed by another segment, and in pad tails."""
    b, length = probed.batch.shape
    labels = _whole_rows(seen, seen.labels)
    has_target = (labels != IGNORE_INDEX) & (labels != UNSEEN)
    crossing = torch.zeros(b, length, dtype=torch.bool)
    pad = torch.zeros(b, length, dtype=torch.bool)
    for r in range(b):
        for _, end in probed.segments(r)[:-1]:
            crossing[r, end - 1] = True  # its next position starts another segment
        if probed.pad_tokens[r]:
            pad[r, length - probed.pad_tokens[r] :] = True
    out = []
    for name, flagged, what in (
        ("boundary_loss/crossing", crossing & has_target, "target(s) across a document end"),
        ("boundary_loss/pad", pad & has_target, "target(s) in the pad tail"),
    ):
        where = ""
        if flagged.any():
            r, position = (int(i) for i in flagged.nonzero()[0])
            k = int(probed.batch.doc_ids[r, position])
            where = (
                f"row {r}: {int(flagged[r].sum())} {what}, the first at token {position} of "
                f"document {k}{_span(probed, r, k)}"
            )
        out.append(_judged(name, probed.name, int(flagged.sum()), 0, where))
    return out


def positions(probed: ProbeRows, seen: PackedBatch, reset: bool) -> Result:
    """Position ids the model gets vs the arm's: reset at every segment start, or 0..L-1."""
    batch = probed.batch
    expected = position_ids_for(batch.seq_lens.cpu(), batch.shape[1], reset)
    got = _whole_rows(seen, seen.position_ids)
    wrong = (got != expected) & (got != UNSEEN)
    where = ""
    if wrong.any():
        r, position = (int(i) for i in wrong.nonzero()[0])
        k = int(batch.doc_ids[r, position])
        start, end = probed.segments(r)[k]
        arm = "reset" if reset else "continuous"
        where = (
            f"row {r}, document {k}{_span(probed, r, k)}: {int(wrong[r, start:end].sum())} "
            f"position ids differ from the {arm} arm's; the first, at token {position}, is "
            f"{int(got[r, position])}, expected {int(expected[r, position])}"
        )
    return _judged("positions", probed.name, int(wrong.sum()), 0, where)


def _whole_rows(seen: PackedBatch, values_Bl: Tensor) -> Tensor:
    """[B, L] int64 on the CPU: the values every rank's shard holds, at their row positions
    (UNSEEN where no rank holds one: only when the ranks are simulated in one process)."""
    b, row_len = seen.shape[0], seen.row_len
    rows = torch.full((b, row_len), UNSEEN, dtype=torch.int64, device=values_Bl.device)
    rows.scatter_(1, _local_index(seen).to(rows.device), values_Bl.long())
    return _all_reduce(rows, dist.ReduceOp.MAX).cpu()


@dataclasses.dataclass
class Outputs:
    """A forward's outputs on this rank's tokens: logits [B, l, V] (compute dtype), per-token
    loss [B, l] (fp32) and the row positions [B, l] of the local tokens (a context-parallel
    plan may give each row's rank other positions)."""

    logits: Tensor
    loss: Tensor
    index: Tensor


def _run(target: Target, batch: PackedBatch) -> Outputs:
    seen = target.shard(batch)
    with torch.no_grad(), target.context():
        logits, loss = target.forward(seen)
    return Outputs(logits, loss.float(), _local_index(seen))


def _local_index(seen: PackedBatch) -> Tensor:
    if isinstance(seen, ContextShard):
        return seen.global_index
    return torch.arange(seen.shape[1], device=seen.tokens.device).expand(seen.shape[0], -1)


def _token_diff(a: Outputs, b: Outputs) -> tuple[Tensor, Tensor]:
    """Per-token max |difference| of logits (over the vocabulary) and of losses: [B, l] each."""
    logits = (a.logits.float() - b.logits.float()).abs().amax(-1)
    return logits, (a.loss - b.loss).abs()


@dataclasses.dataclass
class NoiseFloor:
    """The repeated forward's relative differences and the magnitudes they are relative to."""

    logits: float
    loss: float
    logits_scale: float
    loss_scale: float
    dtype: torch.dtype

    def tolerance(self, check: str, which: str, override: float | None) -> float:
        if override is not None:
            return override
        floors = ISOLATION_FLOOR if check == "isolation" else EQUIVALENCE_FLOOR
        floor = floors.get(self.dtype, floors[torch.float32])
        return max(NOISE_FACTOR * getattr(self, which), floor)

    def relative(self, diffs: Tensor) -> Tensor:
        """[2, ...] max |difference| of (logits, loss) over the world, relative to their scales."""
        diffs = _all_reduce(diffs, dist.ReduceOp.MAX).cpu()
        diffs[0] /= self.logits_scale
        diffs[1] /= self.loss_scale
        return diffs

    def results(self, rows: str) -> list[Result]:
        note = f"{NOISE_REPEATS} repeats, {_dtype_name(self.dtype)}"
        return [
            Result("noise_floor/logits", rows, self.logits, None, "info", note),
            Result("noise_floor/loss", rows, self.loss, None, "info", note),
        ]


def _reference(target: Target, batch: PackedBatch) -> tuple[Outputs, NoiseFloor]:
    """The unperturbed outputs, and the noise floor of repeating them."""
    ref = _run(target, batch)
    noise = torch.zeros(2, device=ref.loss.device)
    for _ in range(NOISE_REPEATS):
        logits, loss = _token_diff(_run(target, batch), ref)
        noise = torch.maximum(noise, torch.stack([logits.max(), loss.max()]))
    scales = torch.stack([ref.logits.float().abs().max(), ref.loss.abs().max()])
    noise, scales = (_all_reduce(t, dist.ReduceOp.MAX).tolist() for t in (noise, scales))
    scales = [s if s > 0 else 1.0 for s in scales]
    floor = NoiseFloor(noise[0] / scales[0], noise[1] / scales[1], *scales, ref.logits.dtype)
    return ref, floor


def isolation(
    target: Target,
    probed: ProbeRows,
    ref: Outputs,
    noise: NoiseFloor,
    override: float | None = None,
    seed: int = 0,
) -> list[Result]:
    """Forward j perturbs segment j of every row (rows with fewer segments stay as they are);
    no other segment may move. The batch keeps its layout, so a masked backend computes the
    other segments exactly as in the reference. Also the positive control: the longest
    document of each row with its first token perturbed must move."""
    batch = probed.batch
    b, num_segments = batch.seq_lens.shape
    doc_ids = batch.doc_ids.gather(1, ref.index.to(batch.doc_ids.device))
    moved = torch.zeros(2, b, num_segments, num_segments, device=ref.loss.device)  # r, j, k
    for j in range(num_segments):
        spans = {r: probed.segments(r)[j] for r in range(b) if j < len(probed.segments(r))}
        outputs = _run(target, _perturbed(batch, spans, target.vocab_size, seed, j))
        for w, diff_BL in enumerate(_token_diff(outputs, ref)):
            for r in range(b):
                moved[w, r, j] = _segment_max(diff_BL[r], doc_ids[r], num_segments)
    control = _positive_control(target, probed, ref, seed)
    moved = noise.relative(moved)
    moved[:, :, range(num_segments), range(num_segments)] = 0  # a segment's own change
    tols = [noise.tolerance("isolation", which, override) for which in ("logits", "loss")]
    results = [_control_result(probed, control, noise, tols[0])]
    for w, which in enumerate(("logits", "loss")):
        measured, where = float(moved[w].max()), _first_leak(probed, moved[w], tols[w])
        results.append(_judged(f"isolation/{which}", probed.name, measured, tols[w], where))
    return results


def _positive_control(target, probed: ProbeRows, ref: Outputs, seed: int) -> Tensor:
    """Per row: the max |change| of the longest document's later logits when its first token
    changes (-1 for a row without a document of 2 or more tokens). One forward: every row's."""
    b = probed.batch.shape[0]
    control = torch.full((b,), -1.0, device=ref.loss.device)
    longest = {r: k for r in range(b) if (k := _longest_document(probed, r)) is not None}
    firsts = {
        r: (probed.segments(r)[k][0], probed.segments(r)[k][0] + 1) for r, k in longest.items()
    }
    outputs = _run(target, _perturbed(probed.batch, firsts, target.vocab_size, seed, -1))
    diff_BL = _token_diff(outputs, ref)[0]
    for r, k in longest.items():
        start, end = probed.segments(r)[k]
        later = (ref.index[r] > start) & (ref.index[r] < end)
        control[r] = diff_BL[r, later].max() if later.any() else 0.0
    return _all_reduce(control, dist.ReduceOp.MAX).cpu()


def _longest_document(probed: ProbeRows, row: int) -> int | None:
    lengths = [
        (end - start, k)
        for k, (start, end) in enumerate(probed.segments(row))
        if not probed.is_pad(row, k) and end - start >= 2
    ]
    return max(lengths, key=lambda t: (t[0], -t[1]))[1] if lengths else None


def _control_result(probed, control: Tensor, noise: NoiseFloor, tol: float) -> Result:
    need = CONTROL_MARGIN * tol
    rows = [r for r in range(len(control)) if control[r] >= 0]
    if not rows:
        where = "no row holds a document of 2 or more tokens"
        return _judged("positive_control", probed.name, 0.0, need, where)
    weakest = min(rows, key=lambda r: float(control[r]))
    value = float(control[weakest]) / noise.logits_scale
    where = ""
    if value <= need:
        k = _longest_document(probed, weakest)
        where = (
            f"row {weakest}, document {k}{_span(probed, weakest, k)}: changing its first token "
            f"moved its later logits by {value:.3g} only; the probe cannot tell a leak from noise"
        )
    note = f"must exceed {CONTROL_MARGIN:g}x the isolation tolerance"
    return _judged("positive_control", probed.name, value, need, where, note)


def _first_leak(probed: ProbeRows, moved_BSS: Tensor, tol: float) -> str:
    over = (moved_BSS > tol).nonzero()
    if not len(over):
        return ""
    r, j, k = (int(i) for i in over[0])
    if j < len(probed.segments(r)):
        what = "its pad tail" if probed.is_pad(r, j) else f"document {j}{_span(probed, r, j)}"
        what += f" (and segment {j} of the other rows)"
    else:
        what = f"segment {j} of the other rows (this row has none: a leak across rows)"
    return (
        f"row {r}, document {k}{_span(probed, r, k)} moved by {float(moved_BSS[r, j, k]):.3g} "
        f"when {what} was perturbed"
    )


def _perturbed(
    batch: PackedBatch, spans: dict[int, tuple[int, int]], vocab_size: int, seed: int, j: int
) -> PackedBatch:
    """The batch with tokens [start, end) of row r replaced, for every row r in ``spans``."""
    tokens = batch.tokens.clone()
    for r, (start, end) in spans.items():
        tokens[r, start:end] = _perturb(tokens[r, start:end], vocab_size, seed, r, j)
    return PackedBatch(tokens, batch.labels, batch.position_ids, batch.seq_lens)


def _perturb(tokens: Tensor, vocab_size: int, seed: int, row: int, segment: int) -> Tensor:
    """Other ids in [0, vocab_size), the same on every rank (a seeded CPU generator)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + row * 1009 + segment + 1)
    shift = torch.randint(1, vocab_size, tokens.shape, generator=gen).to(tokens.device)
    return (tokens % vocab_size + shift) % vocab_size


def _segment_max(values_l: Tensor, doc_ids_l: Tensor, num_segments: int) -> Tensor:
    """[S] max of a row's per-token values over each segment's (local) tokens."""
    out = torch.zeros(num_segments, device=values_l.device, dtype=torch.float32)
    return out.scatter_reduce_(0, doc_ids_l, values_l.flatten().float(), "amax")


def equivalence(
    target: Target,
    probed: ProbeRows,
    ref: Outputs,
    noise: NoiseFloor,
    override: float | None = None,
) -> list[Result]:
    """Each segment alone (its tokens, labels and position ids from the row, no shard) vs the
    row's outputs at its positions on this rank."""
    batch = probed.batch
    b, num_segments = batch.seq_lens.shape
    diffs = torch.zeros(2, b, num_segments, device=ref.loss.device)
    for r in range(b):
        for k, (start, end) in enumerate(probed.segments(r)):
            alone = PackedBatch(
                batch.tokens[r : r + 1, start:end],
                batch.labels[r : r + 1, start:end],
                batch.position_ids[r : r + 1, start:end],
                torch.full((1, 1), end - start, dtype=torch.int32, device=batch.seq_lens.device),
            )
            with torch.no_grad(), target.context():
                logits, loss = target.forward(alone)
            local = (ref.index[r] >= start) & (ref.index[r] < end)
            if not local.any():
                continue
            at = ref.index[r, local] - start
            d_logits = (ref.logits[r, local].float() - logits[0, at].float()).abs().max()
            d_loss = (ref.loss[r, local] - loss[0, at].float()).abs().max()
            diffs[:, r, k] = torch.stack([d_logits, d_loss])
    diffs = noise.relative(diffs)
    results = []
    for w, which in enumerate(("logits", "loss")):
        tol = noise.tolerance("equivalence", which, override)
        where = ""
        if (diffs[w] > tol).any():
            r, k = (int(i) for i in (diffs[w] > tol).nonzero()[0])
            where = (
                f"row {r}, document {k}{_span(probed, r, k)}: run alone its {which} differ by "
                f"{float(diffs[w, r, k]):.3g}"
            )
        results.append(
            _judged(f"equivalence/{which}", probed.name, float(diffs[w].max()), tol, where)
        )
    return results


def _judged(check: str, rows: str, measured, tolerance, where: str, note: str = "") -> Result:
    """A check's result: failed when it names where (its first failure), passed otherwise."""
    return Result(check, rows, measured, tolerance, "fail" if where else "pass", where, note)


def _span(probed: ProbeRows, row: int, segment: int) -> str:
    start, end = probed.segments(row)[segment]
    pad = ", pad tail" if probed.is_pad(row, segment) else ""
    return f" (tokens {start}:{end}{pad})"


def _all_reduce(t: Tensor, op) -> Tensor:
    """Reduced over the world when there is one (every rank reaches the same verdict)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op)
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
