"""Capacity planner: per-rank memory and step time of a training run, before anything is allocated.

``dry_run=true`` prints a :class:`Plan`. Memory is a list of named terms in bytes per rank,
each derived from what the code keeps, not from a rule of thumb:

- parameters, gradients, AdamW state: fp32 (the optimizer's master copy), divided over the
  world under FSDP2 (which shards over every rank, context-parallel ones included);
- saved activations: what autograd keeps per transformer block (counted tensor by tensor in
  :func:`layer_activation_bytes`, checked against autograd's saved tensors in the tests);
  with activation checkpointing only each block's input, plus one block recomputed in backward;
- the working sets of one block's feed-forward and attention backward, the chunked loss's
  logits buffers, eager's dense mask, context parallelism's K/V gradient and kept key spans,
  FSDP2's gathered parameters, autocast's bf16 weights; each transient term is alive in some
  of backward's phases (loss, then per block feed-forward and attention), which do not overlap;
- a runtime baseline: on CPU the measured RSS of this process (Python, torch and the app's
  imports); on a GPU a stated allowance for the CUDA context and NCCL buffers.

Step time is a roofline: model FLOPs (``longctx.model.estimate_flops``, attention inside
documents only) over peak x MFU, plus FSDP2's parameter traffic where it outlasts compute
(prefetched, so it overlaps) and the K/V all-gather, which sits on the critical path.

    python benchmarks/plan_table.py   # docs/planner.md's Llama 3 8B table -> results/planning_table.json
"""

from __future__ import annotations

import dataclasses
import functools
import math
import resource
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from longctx.distributed.cp_balance import (
    DEFAULT_BALANCE,
    check_balance,
    plan_stats,
    rank_unit,
    row_owner,
)
from longctx.model.config import LlamaConfig
from longctx.model.flops import estimate_flops, training_flops

GIB = 2**30
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
# (memory GB as sold, dense bf16 FLOP/s) of accelerators the planner knows by name
KNOWN_DEVICES = {"H100": (80, 989e12), "H200": (141, 989e12), "A100": (80, 312e12)}
# CUDA context, NCCL buffers and allocator slack per GPU: a stated allowance, not measured here
CUDA_RUNTIME_BYTES = 2 * GIB
# NVLink 4 all-gather bus bandwidth within a node; one 400 Gb/s NIC per GPU between nodes
INTRA_NODE_BYTES_PER_S = 360e9
INTER_NODE_BYTES_PER_S = 45e9
# no GPU MFU has been measured in this project yet: a stated assumption (set planner.mfu)
DEFAULT_MFU = 0.40
# fp32 weights (the optimizer's master copy), fp32 gradients, AdamW's two fp32 moments
WEIGHT_BYTES, GRADIENT_BYTES, ADAMW_BYTES = 4, 4, 8
# glibc's heap as train.py runs on CPU (longctx.train.cpu_memory.retain_freed_memory): freed
# blocks stay mapped for the next step, and their fragments leave the heap larger than the
# tensors alive at once. Measured on train.py's own path (the tiny model, micro-batch 1, peak RSS
# against this plan; benchmarks/bench_train_rss.py, results/train_rss.json) the excess is 0.22-0.30
# of the step tensors' peak after one step at 16k-64k, and grows over the first steps to 0.38
# (32k) - 0.49 (16k), where it holds (8 and 30 steps at 16k agree): an allowance, not a model of
# malloc, that keeps the plan within 12% of both
CPU_HEAP_RETENTION = 0.40


class PlanError(ValueError):
    """A planning input that is missing or cannot work; the message names the key to set."""


def require_positive(name: str, value, setting: str) -> None:
    """A finite positive number, or a PlanError naming the setting it comes from."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{setting}={value!r}: the {name}; expected a finite positive number")


@dataclass(frozen=True)
class PlannerSettings:
    """The ``planner`` config group: what a dry run plans for (see conf/train.yaml)."""

    device: str | None = None
    device_memory_gb: float | None = None  # None: the visible GPU's, the table's or the host's
    mfu: float = DEFAULT_MFU
    intra_node_gb_per_s: float = INTRA_NODE_BYTES_PER_S / 1e9
    inter_node_gb_per_s: float = INTER_NODE_BYTES_PER_S / 1e9
    # a stated lognormal of document lengths (median tokens, sigma); None = one per row
    doc_length_median: float | None = None
    doc_length_sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.device is not None and not isinstance(self.device, str):
            raise PlanError(f"planner.device={self.device!r}; expected an accelerator name or null")
        if self.device_memory_gb is not None:
            require_positive(
                "memory of one device", self.device_memory_gb, "planner.device_memory_gb"
            )
        require_positive("model FLOPs utilisation", self.mfu, "planner.mfu")
        if self.mfu > 1:
            raise PlanError(f"planner.mfu={self.mfu}; expected a fraction in (0, 1]")
        for key in ("intra_node_gb_per_s", "inter_node_gb_per_s"):
            require_positive("collective bandwidth per GPU", getattr(self, key), f"planner.{key}")
        if self.doc_length_median is not None:
            require_positive(
                "median document length", self.doc_length_median, "planner.doc_length_median"
            )
        require_positive(
            "document length spread", self.doc_length_sigma, "planner.doc_length_sigma"
        )

    @classmethod
    def from_dict(cls, settings: dict) -> PlannerSettings:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise PlanError(
                f"planner.{unknown[0]}: unknown planner setting{'s' if len(unknown) > 1 else ''} "
                f"{unknown}; expected one of {known}"
            )
        return cls(**settings)


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_flops: float | None  # dense FLOP/s of one device in the compute dtype; None = unknown
    baseline_bytes: int  # what the process holds outside tensors (see module docstring)
    baseline_note: str
    intra_node_bytes_per_s: float = INTRA_NODE_BYTES_PER_S
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S
    # the allocator's excess over the tensors alive at once, as a fraction of their peak
    # (CPU_HEAP_RETENTION for train.py on CPU; 0 where a caching allocator reuses exactly)
    heap_retention: float = 0.0

    def __post_init__(self) -> None:
        require_positive("device memory", self.memory_bytes, "planner.device_memory_gb")
        if not (math.isfinite(self.heap_retention) and self.heap_retention >= 0):
            raise PlanError(f"heap_retention={self.heap_retention!r}; expected a fraction >= 0")
        if self.peak_flops is not None:
            require_positive("peak FLOP/s", self.peak_flops, "peak_flops_per_device")
        for name, key in (
            ("intra_node_bytes_per_s", "intra_node_gb_per_s"),
            ("inter_node_bytes_per_s", "inter_node_gb_per_s"),
        ):
            setting = f"{name} (planner.{key} x 1e9)"
            require_positive("collective bandwidth per GPU", getattr(self, name), setting)


@dataclass(frozen=True)
class Layout:
    """How a run is laid out over ranks, and what each rank computes."""

    seq_len: int
    micro_batch_size: int = 1
    num_nodes: int = 1
    devices: int = 1  # per node
    context_parallel: int = 1
    context_parallel_rounds: int = 1
    context_parallel_balance: str = DEFAULT_BALANCE
    fsdp: bool = False  # FSDP2 over the world; otherwise replicated (DDP / one process)
    precision: str = "fp32"  # fp32 | bf16-mixed (autocast, fp32 residual) | bf16 (FSDP2 bf16)
    activation_checkpointing: bool = False
    attn_backend: str = "sdpa"  # resolved: flash | flex | sdpa | eager
    accumulate_grad_batches: int = 1
    max_steps: int = 1
    # a row's document lengths (cycled to fill a row); empty = one document per row (worst case)
    doc_lengths: tuple[int, ...] = ()
    # a stated length distribution instead: lognormal (median, sigma) documents packed into
    # rows in order, the last one cut at the row's end (rows are sampled: LENGTH_SAMPLE_ROWS)
    doc_length_lognormal: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r}; expected one of {PRECISIONS}")
        for name in ("seq_len", "micro_batch_size", "num_nodes", "devices", "context_parallel"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)}; expected >= 1")
        try:
            check_balance(self.context_parallel_balance, self.context_parallel_rounds)
        except ValueError as err:
            raise PlanError(str(err)) from err
        if self.doc_length_lognormal is not None:
            median, sigma = self.doc_length_lognormal
            if not (median >= 1 and 0 <= sigma < 10):  # also refuses NaN
                raise PlanError(
                    f"doc_length_lognormal=({median}, {sigma}); expected a median >= 1 token "
                    "and 0 <= sigma < 10"
                )

    @property
    def world(self) -> int:
        return self.num_nodes * self.devices

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one micro-batch on one rank: its rows, or its share of them under CP."""
        return self.micro_batch_size * self.seq_len // self.context_parallel

    @property
    def residual_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


# Backward runs through phases that do not overlap in time: the chunked loss, then block by block
# the feed-forward's backward, then the attention's. A transient term is alive in some of them.
LOSS_PHASE, FFN_PHASE, ATTENTION_PHASE = "loss", "feed-forward", "attention"
BLOCK_PHASES = (FFN_PHASE, ATTENTION_PHASE)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str = ""
    phases: tuple[str, ...] = ()  # () = held throughout backward; else alive only in these


@dataclass(frozen=True)
class StepTime:
    flops_per_rank: float  # model FLOPs of one optimizer step on one rank
    peak_flops: float
    mfu: float
    compute_s: float
    fsdp_bytes: float  # parameter all-gathers + gradient reduce-scatter received per rank
    fsdp_s: float
    kv_bytes: float  # context-parallel K/V all-gather + reduce-scatter received per rank
    kv_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    wall_s: float  # max_steps steps
    documents: str
    cp_work_imbalance: float = 1.0  # expected max / mean attention work over the CP ranks


@dataclass(frozen=True)
class Plan:
    layout: Layout
    device: Device
    terms: tuple[Term, ...]
    activations_per_layer: dict[str, int]  # saved bytes of one block, without / with checkpointing
    step: StepTime | None
    suggestion: Layout | None = None
    suggestion_change: str = ""
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Held terms plus the largest phase's transient terms: the peak."""
        return peak_bytes(self.terms)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device.memory_bytes

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


def peak_bytes(terms) -> int:
    """Held terms plus the largest backward phase's transient terms."""
    held = sum(t.bytes for t in terms if not t.phases)
    phases = {p for t in terms for p in t.phases}
    return held + max((sum(t.bytes for t in terms if p in t.phases) for p in phases), default=0)


# --------------------------------------------------------------------------- memory terms
def layer_activation_bytes(config: LlamaConfig, layout: Layout, tokens: int) -> int:
    """Bytes autograd saves in one transformer block for ``tokens`` tokens on this rank.

    Per token: both norms' inputs (residual dtype) and 1/rms (fp32); the linear inputs (the
    attention norm output, attention output and ffn norm output; per linear under autocast);
    q, k, v after RoPE and the attention output; the logsumexp (fp32, per head); SwiGLU's four
    [ffn_dim] tensors (w1 and w3 outputs, silu, product). Under autocast RoPE's cos/sin are
    cast per call (for q and for k). Eager adds its [H, L, L] probabilities and repeated K/V.
    """
    c, r, k = config, layout.residual_bytes, layout.compute_bytes
    per_token = 2 * c.dim * r + 2 * 4  # norm inputs, 1/rms
    # linear inputs; autocast casts an activation once per linear that reads it (it caches
    # only weights), so wq/wk/wv and w1/w3 each keep their own bf16 copy
    per_token += (6 if layout.precision == "bf16-mixed" else 3) * c.dim * k
    per_token += (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim * k + c.n_heads * 4
    per_token += 4 * c.ffn_dim * k
    if layout.precision == "bf16-mixed":
        per_token += 2 * c.head_dim * k  # cos and sin cast to bf16, for q and for k
    total = tokens * per_token
    if layout.attn_backend == "eager":  # each local query against its whole row's keys
        total += c.n_heads * tokens * layout.seq_len * 4  # fp32 probabilities
        total += 2 * tokens * c.n_heads * c.head_dim * 4  # k, v repeated to every head, fp32
    return total


def ffn_activation_bytes(config: LlamaConfig, layout: Layout, tokens: int) -> int:
    """The feed-forward half of :func:`layer_activation_bytes`: its norm's input and 1/rms,
    w1's and w3's input (one copy per linear under autocast) and SwiGLU's four [ffn_dim]
    tensors. Its backward frees them before the attention's backward begins."""
    c, k = config, layout.compute_bytes
    linear_inputs = 2 if layout.precision == "bf16-mixed" else 1
    per_token = c.dim * layout.residual_bytes + 4 + linear_inputs * c.dim * k + 4 * c.ffn_dim * k
    return tokens * per_token


def activation_terms(config: LlamaConfig, layout: Layout) -> list[Term]:
    """Saved activations. The block being backpropagated is its own pair of terms: its
    feed-forward half is freed before its attention's backward runs. Without checkpointing
    every block is saved through the loss's backward; with it, only the block inputs are, and
    the block recomputed in backward saves its attention norm's input no second time (it is
    the checkpointed input)."""
    c, tokens = config, layout.tokens_per_rank
    layer = layer_activation_bytes(config, layout, tokens)
    ffn_half = ffn_activation_bytes(config, layout, tokens)
    block_input = tokens * c.dim * layout.residual_bytes
    if layout.activation_checkpointing:
        held = Term(
            f"activations ({c.n_layers} block inputs, checkpointed)", c.n_layers * block_input
        )
        block, attention_half = "recomputed block", layer - ffn_half - block_input
        ffn_phases, attention_phases = (FFN_PHASE,), BLOCK_PHASES
    else:
        held = Term(f"activations ({c.n_layers - 1} other blocks saved)", (c.n_layers - 1) * layer)
        block, attention_half = "block in backward", layer - ffn_half
        ffn_phases, attention_phases = (LOSS_PHASE, FFN_PHASE), (LOSS_PHASE, *BLOCK_PHASES)
    rope_and_ids = tokens * (c.head_dim * 4 + 8 * 3)  # fp32 cos and sin; int64 ids
    return [
        held,
        Term(f"activations: {block}, attention half", attention_half, phases=attention_phases),
        Term(f"activations: {block}, feed-forward half", ffn_half, phases=ffn_phases),
        Term("RoPE tables and ids", rope_and_ids, "shared by every block"),
        # the last block's output and the final norm's: freed once the loss's backward is done
        Term("final norm input and output", 2 * block_input, phases=(LOSS_PHASE,)),
    ]


def ffn_working_bytes(config: LlamaConfig, layout: Layout) -> int:
    """Gradients alive at once in the feed-forward's backward, beyond its saved tensors: at
    the SwiGLU product's backward, the gradients of silu's and of w3's outputs ([ffn_dim] each;
    the product's own gradient and saved tensors are freed as they are consumed), and the
    residual stream's gradient with the branch's ([dim] each)."""
    k = layout.compute_bytes
    per_token = 2 * config.ffn_dim * k + 2 * config.dim * layout.residual_bytes
    return layout.tokens_per_rank * per_token


def attention_working_bytes(config: LlamaConfig, layout: Layout) -> int:
    """Gradients alive at once in the attention kernel's backward: of its output and q
    ([n_heads x head_dim] each), of the local k and v, and the residual stream's and the
    branch's ([dim] each); eager adds the probabilities' and the scores' gradients."""
    c, tokens, k = config, layout.tokens_per_rank, layout.compute_bytes
    per_token = (
        2 * c.n_heads + 2 * c.n_kv_heads
    ) * c.head_dim * k + 2 * c.dim * layout.residual_bytes
    total = tokens * per_token
    if layout.attn_backend == "eager":
        total += 2 * c.n_heads * tokens * layout.seq_len * 4
    return total


def loss_bytes(config: LlamaConfig, layout: Layout) -> int:
    """The fused chunked loss (longctx.model.loss): one fp32 [chunk, vocab] buffer, allocated in
    forward and refilled chunk by chunk in backward, plus one in the compute dtype under bf16 for
    the matmuls; the hidden states' gradient [tokens, dim] and the output weight's [vocab, dim]
    in the compute dtype. The weight's is the parameter's own gradient, which the gradients term
    holds, for fp32 or bf16 weights unsharded; under bf16-mixed it is cast to the fp32 gradient
    and under FSDP reduce-scattered, then freed, so it is counted here."""
    c, k = config, layout.compute_bytes
    chunk = min(layout.tokens_per_rank, c.loss_chunk_size)
    buffers = chunk * c.vocab_size * (4 + (k if k != 4 else 0))
    grad_hidden = layout.tokens_per_rank * c.dim * k
    own_weight_gradient = (layout.fsdp and layout.world > 1) or layout.precision == "bf16-mixed"
    return buffers + grad_hidden + (c.vocab_size * c.dim * k if own_weight_gradient else 0)


def gathered_kv_terms(config: LlamaConfig, layout: Layout) -> list[Term]:
    """Context parallelism: the gradient of the whole rows' K and V of one block, and, kept per
    block for backward, the key spans the local queries need: all of the row for flex and
    eager; for sdpa/flash the documents that cross into this rank's 2 x rounds chunks. Under
    the documents balancer the kept spans are the split documents', estimated the same way as
    one round (on bench_cp's rows at 32k the rank keeping the most holds 0.97x of the estimate
    at 2 ranks, 1.3x at 8).

    The gathered rows themselves are not saved (the all-gather and the span selection keep no
    input for backward): they live inside the attention's forward. Their gradient is built in
    the attention's backward (the span selection's backward scatters into a whole row) and
    reduce-scattered there, after the feed-forward's backward has freed its tensors."""
    if layout.context_parallel == 1:
        return []
    c = config
    row_kv = 2 * layout.micro_batch_size * layout.seq_len * c.n_kv_heads * c.head_dim
    row_kv *= layout.compute_bytes
    if layout.attn_backend in ("flex", "eager"):
        kept_fraction = 1.0
    else:
        spans = 2 * layout.context_parallel_rounds * size_biased_mean(layout)
        kept_fraction = min(1.0, spans / layout.seq_len)
    kept = int(row_kv * kept_fraction)
    gradient = Term("gathered K/V's gradient (one block)", row_kv, phases=(ATTENTION_PHASE,))
    if layout.activation_checkpointing:  # the recomputed block's
        return [gradient, Term("kept K/V spans (context parallel)", kept, phases=BLOCK_PHASES)]
    return [gradient, Term("kept K/V spans (context parallel)", kept * c.n_layers)]


def size_biased_mean(layout: Layout) -> float:
    """Mean length of the document a random token sits in (sum n^2 / sum n)."""
    lens = np.concatenate(layout_rows(layout))
    return float((lens.astype(np.float64) ** 2).sum() / lens.sum())


@functools.cache
def layout_rows(layout: Layout) -> tuple[np.ndarray, ...]:
    """The rows the plan is computed for: the one that ``doc_lengths`` gives, or
    LENGTH_SAMPLE_ROWS drawn (seeded) from ``doc_length_lognormal``."""
    if layout.doc_length_lognormal is None:
        return (np.array(row_lengths(layout), dtype=np.int64),)
    rng = np.random.default_rng(0)
    median, sigma = layout.doc_length_lognormal
    return tuple(
        lognormal_row(layout.seq_len, median, sigma, rng) for _ in range(LENGTH_SAMPLE_ROWS)
    )


def row_lengths(layout: Layout) -> list[int]:
    """One row's document lengths: ``doc_lengths`` cycled and cut to fill seq_len."""
    if not layout.doc_lengths:
        return [layout.seq_len]
    lens, total, i = [], 0, 0
    while total < layout.seq_len:
        n = min(layout.doc_lengths[i % len(layout.doc_lengths)], layout.seq_len - total)
        lens.append(n)
        total, i = total + n, i + 1
    return lens


def parameter_terms(config: LlamaConfig, layout: Layout) -> list[Term]:
    """fp32 weights (the optimizer's master copy), fp32 gradients, AdamW's two fp32 moments;
    FSDP2 divides each over the world and gathers a block at a time (two with prefetch), plus
    the root (embeddings, output, final norm), in the compute dtype, with one block's
    unsharded gradients. Autocast caches a bf16 copy of every weight for the step."""
    params = config.num_params()
    shards = layout.world if layout.fsdp else 1
    where = f"sharded over {shards} ranks" if shards > 1 else "replicated"
    terms = [
        Term("parameters (fp32)", params * WEIGHT_BYTES // shards, where),
        Term("gradients (fp32)", params * GRADIENT_BYTES // shards, where),
        Term("optimizer state (AdamW, fp32 x 2)", params * ADAMW_BYTES // shards, where),
    ]
    if layout.fsdp and shards > 1:
        block = (params - root_params(config)) // config.n_layers
        gathered = (root_params(config) + 2 * block) * layout.compute_bytes + block * 4
        terms.append(
            Term("gathered parameters (FSDP2)", gathered, "root + 2 blocks + 1 block's grads")
        )
    if layout.precision == "bf16-mixed":
        terms.append(Term("bf16 weight copies (autocast cache)", params * 2))
    return terms


def training_state_bytes(params: int, shards: int = 1) -> int:
    """Weights, gradients and AdamW state per device, activations not included: the floor that
    any model (longctx's Llama or a transformers one) needs before its first step."""
    return params * (WEIGHT_BYTES + GRADIENT_BYTES + ADAMW_BYTES) // max(shards, 1)


def root_params(config: LlamaConfig) -> int:
    tables = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    return tables + config.dim


def memory_terms(config: LlamaConfig, layout: Layout, device: Device) -> list[Term]:
    parameters = parameter_terms(config, layout)
    terms = step_tensor_terms(config, layout)
    retained = retained_heap_term(terms, device)
    runtime = Term("runtime baseline", device.baseline_bytes, device.baseline_note)
    return parameters + terms + ([retained] if retained else []) + [runtime]


def retained_heap_term(step_terms: list[Term], device: Device) -> Term | None:
    """The allocator's excess over a step's tensors: ``heap_retention`` x their peak, held
    (the heap keeps it for the rest of the run)."""
    if not device.heap_retention:
        return None
    return Term(
        "retained heap (glibc, freed blocks kept)",
        int(device.heap_retention * peak_bytes(step_terms)),
        f"{device.heap_retention:.2f} x the step tensors' peak, measured on train.py",
    )


def step_tensor_terms(config: LlamaConfig, layout: Layout) -> list[Term]:
    """What one step allocates beyond the parameters and optimizer state: activations, the
    backward working sets, the loss buffers, eager's mask and context parallelism's K/V."""
    terms = activation_terms(config, layout)
    terms += [
        Term(
            "feed-forward backward working set",
            ffn_working_bytes(config, layout),
            phases=(FFN_PHASE,),
        ),
        Term(
            "attention backward working set",
            attention_working_bytes(config, layout),
            phases=(ATTENTION_PHASE,),
        ),
    ]
    chunk = min(layout.tokens_per_rank, config.loss_chunk_size)
    terms.append(
        Term(
            "chunked loss buffers",
            loss_bytes(config, layout),
            f"{chunk}-token chunk x vocab",
            phases=(LOSS_PHASE,),
        )
    )
    if layout.attn_backend == "eager":
        mask = layout.tokens_per_rank * layout.seq_len  # [B, L/CP, L] bool
        terms.append(Term("dense L x L mask (eager)", mask, "bool"))
    return terms + gathered_kv_terms(config, layout)


# --------------------------------------------------------------------------- step time
def step_time(config: LlamaConfig, layout: Layout, device: Device, mfu: float) -> StepTime:
    if device.peak_flops is None:
        raise PlanError(
            f"peak FLOP/s of a {device.name} device is unknown: set peak_flops_per_device "
            "(dense FLOP/s of one device in the compute dtype, e.g. 989e12 for an H100 in bf16)"
        )
    if not 0 < mfu <= 1:
        raise PlanError(f"planner.mfu={mfu}; expected a fraction in (0, 1]")
    rows = layout_rows(layout)
    lens = pad_sequence([torch.from_numpy(r) for r in rows], batch_first=True)
    row_flops = estimate_flops(config, lens) / len(rows)
    # every layer's all-gather waits for the rank with the most attention work
    imbalance = expected_cp_work_imbalance(layout).mean if layout.context_parallel > 1 else 1.0
    c = config
    attention = training_flops(0, c.head_dim, c.n_heads, c.n_layers, lens) / len(rows)
    row_flops += (imbalance - 1) * attention
    micro = layout.micro_batch_size * row_flops / layout.context_parallel
    flops = micro * layout.accumulate_grad_batches
    compute_s = flops / (device.peak_flops * mfu)
    fsdp_bytes, kv_bytes = fsdp_traffic(config, layout), kv_traffic(config, layout)
    fsdp_s = fsdp_bytes / bandwidth(layout, layout.world, device)
    kv_s = kv_bytes / bandwidth(layout, layout.context_parallel, device)
    step_s = max(compute_s, fsdp_s) + kv_s  # FSDP2 prefetches (overlaps); the K/V gather blocks
    tokens = layout.micro_batch_size * layout.seq_len * layout.accumulate_grad_batches
    tokens_per_gpu = tokens / layout.context_parallel / step_s
    return StepTime(
        flops, device.peak_flops, mfu, compute_s, fsdp_bytes, fsdp_s, kv_bytes, kv_s, step_s,
        tokens_per_gpu, step_s * layout.max_steps, documents_note(layout), imbalance,
    )  # fmt: skip


def documents_note(layout: Layout) -> str:
    if layout.doc_length_lognormal is not None:
        median, sigma = layout.doc_length_lognormal
        return f"lognormal documents, median {median:,.0f}, sigma {sigma}"
    if not layout.doc_lengths:
        return "one document per row (worst case)"
    n = len(layout_rows(layout)[0])
    return f"{n} documents per row (size-biased mean {size_biased_mean(layout):,.0f})"


# --------------------------------------------------------------------------- CP balance
LENGTH_SAMPLE_ROWS = 128  # rows sampled from a stated length distribution (seeded)


@dataclass(frozen=True)
class CpBalance:
    """Expected work imbalance (max / mean over the ranks of in-document causal pairs, what
    training logs as train/cp_work_imbalance) over rows, and pieces of split documents per
    rank, of the layout's balancer: its own plans of the layout's rows."""

    mean: float
    worst: float
    pieces_per_rank: float
    rows: int


@functools.cache
def expected_cp_work_imbalance(layout: Layout) -> CpBalance:
    """The balancer's plans of the layout's rows (:func:`layout_rows`): pure arithmetic on
    lengths, the same code that shards the rows in training."""
    size, balance = layout.context_parallel, layout.context_parallel_balance
    rounds = layout.context_parallel_rounds
    if layout.seq_len % rank_unit(size, balance, rounds):
        raise PlanError(
            f"seq_len={layout.seq_len} does not split over context_parallel={size} with "
            f"context_parallel_balance={balance} (a multiple of {rank_unit(size, balance, rounds)})"
        )
    rows = layout_rows(layout)
    stats = [plan_stats([r], [row_owner(r, size, balance, rounds)], size) for r in rows]
    imbalance = [s.work_imbalance for s in stats]
    pieces = sum(s.pieces_per_rank for s in stats) / len(stats)
    return CpBalance(sum(imbalance) / len(imbalance), max(imbalance), pieces, len(rows))


def lognormal_row(length: int, median: float, sigma: float, rng) -> np.ndarray:
    """One row of documents of lognormal lengths (at least 1 token), the last cut to fit."""
    lens, total = [], 0
    while total < length:
        n = max(1, min(int(median * math.exp(sigma * rng.standard_normal())), length - total))
        lens.append(n)
        total += n
    return np.array(lens, dtype=np.int64)


def fsdp_traffic(config: LlamaConfig, layout: Layout) -> float:
    """Bytes one rank receives per optimizer step: parameters all-gathered in forward and again
    in backward (resharded after forward) per micro-batch, and again in the recompute with
    checkpointing; fp32 gradients reduce-scattered once per step."""
    if not layout.fsdp or layout.world == 1:
        return 0.0
    others = (layout.world - 1) / layout.world
    gathers = 3 if layout.activation_checkpointing else 2
    params = config.num_params()
    per_micro = gathers * params * layout.compute_bytes * others
    return per_micro * layout.accumulate_grad_batches + params * 4 * others


def kv_traffic(config: LlamaConfig, layout: Layout) -> float:
    """Bytes one rank receives per optimizer step for K and V: per block, the forward
    all-gather (again in the recompute with checkpointing) and the backward reduce-scatter."""
    cp = layout.context_parallel
    if cp == 1:
        return 0.0
    c = config
    per_block = 2 * layout.micro_batch_size * layout.seq_len * (cp - 1) / cp
    per_block *= c.n_kv_heads * c.head_dim * layout.compute_bytes
    passes = 3 if layout.activation_checkpointing else 2
    return per_block * passes * c.n_layers * layout.accumulate_grad_batches


def bandwidth(layout: Layout, group: int, device: Device) -> float:
    """A group of consecutive ranks larger than a node crosses the network."""
    return (
        device.intra_node_bytes_per_s if group <= layout.devices else device.inter_node_bytes_per_s
    )


# --------------------------------------------------------------------------- plan
def plan(config: LlamaConfig, layout: Layout, device: Device, mfu: float = DEFAULT_MFU) -> Plan:
    """The per-rank plan; when it does not fit, with the smallest change that does."""
    result = _plan(config, layout, device, mfu)
    if result.fits:
        return result
    found = suggest(config, layout, device)
    if found is None:
        return result
    change, suggested = found
    return dataclasses.replace(result, suggestion=suggested, suggestion_change=change)


def _plan(config: LlamaConfig, layout: Layout, device: Device, mfu: float) -> Plan:
    tokens = layout.tokens_per_rank
    per_layer = {
        "without checkpointing": layer_activation_bytes(config, layout, tokens),
        "with checkpointing": tokens * config.dim * layout.residual_bytes,  # the block's input
    }
    step, notes = None, ()
    if device.peak_flops:
        step = step_time(config, layout, device, mfu)
    else:
        notes = (f"step time: unknown peak FLOP/s for {device.name}; set peak_flops_per_device",)
    terms = tuple(memory_terms(config, layout, device))
    return Plan(layout, device, terms, per_layer, step, notes=notes)


def candidates(layout: Layout) -> list[Layout]:
    """Layouts within reach: checkpointing on, a smaller micro-batch, a larger CP size (with
    the nodes it needs), more nodes (for FSDP2 to shard over), and their combinations."""
    found = []
    for checkpointing in dict.fromkeys((layout.activation_checkpointing, True)):
        for mbs in range(layout.micro_batch_size, 0, -1):
            for cp in powers_of_two_from(layout.context_parallel):
                unit = rank_unit(
                    cp, layout.context_parallel_balance, layout.context_parallel_rounds
                )
                if layout.seq_len % unit:
                    continue  # the existing preflight refuses a row that does not split evenly
                for nodes in powers_of_two_from(layout.num_nodes, 4096):
                    if nodes * layout.devices % cp:
                        continue
                    found.append(dataclasses.replace(
                        layout, activation_checkpointing=checkpointing, micro_batch_size=mbs,
                        context_parallel=cp, num_nodes=nodes,
                    ))  # fmt: skip
    return found


def powers_of_two_from(start: int, stop: int = 1024) -> list[int]:
    out = [start]
    while out[-1] * 2 <= stop:
        out.append(out[-1] * 2)
    return out


def changes(old: Layout, new: Layout) -> dict[str, object]:
    keys = ("activation_checkpointing", "micro_batch_size", "context_parallel", "num_nodes")
    return {k: getattr(new, k) for k in keys if getattr(new, k) != getattr(old, k)}


def suggest(config: LlamaConfig, layout: Layout, device: Device) -> tuple[str, Layout] | None:
    """The fitting layout that needs the fewest nodes, then the fewest changed settings, then
    the smallest CP size, no recompute, the largest micro-batch. Candidates are re-planned."""

    def cost(candidate: Layout) -> tuple:
        n_changed = len(changes(layout, candidate))
        return (
            candidate.num_nodes, n_changed, candidate.context_parallel,
            candidate.activation_checkpointing, -candidate.micro_batch_size,
        )  # fmt: skip

    memory_only = dataclasses.replace(device, peak_flops=None)
    for candidate in sorted(candidates(layout), key=cost):
        if candidate != layout and _plan(config, candidate, memory_only, 1.0).fits:
            changed = changes(layout, candidate)
            return ", ".join(f"{k}={v}" for k, v in changed.items()), candidate
    return None


# --------------------------------------------------------------------------- devices
def known_device(name: str, baseline_bytes: int = CUDA_RUNTIME_BYTES) -> Device:
    key = next((k for k in KNOWN_DEVICES if k.lower() in name.lower()), None)
    if key is None:
        raise PlanError(
            f"device {name!r} is not one the planner knows ({sorted(KNOWN_DEVICES)}): set "
            "planner.device_memory_gb and peak_flops_per_device"
        )
    memory_gb, peak = KNOWN_DEVICES[key]
    return Device(key, int(memory_gb * 1e9), peak, baseline_bytes, "CUDA context + NCCL (stated)")


def process_rss_bytes() -> int:
    """Peak RSS of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- report
def format_plan(plan: Plan) -> str:
    lay, dev = plan.layout, plan.device
    strategy = "FSDP2" if lay.fsdp else "replicated"
    lines = [
        f"capacity plan, per rank: {dev.name}, {lay.num_nodes} node(s) x {lay.devices} device(s), "
        f"{strategy}, context_parallel={lay.context_parallel}, {lay.precision}, "
        f"attn_backend={lay.attn_backend}, activation checkpointing "
        f"{'on' if lay.activation_checkpointing else 'off'}",
        f"  row {lay.seq_len:,} tokens x micro_batch_size {lay.micro_batch_size}: "
        f"{lay.tokens_per_rank:,} tokens per rank",
    ]
    lines += [
        f"  {t.name:<52} {t.bytes / GIB:>10.3f} GiB  {' '.join(filter(None, (t.note, phases_note(t))))}"
        for t in plan.terms
    ]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"  {'peak: held + the largest backward phase':<52} {plan.total_bytes / GIB:>10.3f} GiB  of {dev.memory_bytes / GIB:,.1f} "
        f"GiB: {verdict}; largest term: {plan.largest.name}"
    )
    per_layer = ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in plan.activations_per_layer.items())
    lines.append(f"  activations per block: {per_layer}")
    if not plan.fits:
        lines.append(
            f"  smallest change that fits: {plan.suggestion_change}"
            if plan.suggestion
            else "  no single change of checkpointing / micro_batch_size / CP / nodes fits"
        )
    if plan.step:
        s = plan.step
        lines += [
            f"  step time (roofline, {s.documents}): {s.flops_per_rank / 1e12:,.1f} TFLOP per rank"
            f" at {s.peak_flops / 1e12:,.0f} TFLOP/s x MFU {s.mfu:.2f} = {s.compute_s:.3f} s; "
            f"FSDP2 {s.fsdp_bytes / GIB:,.2f} GiB {s.fsdp_s:.3f} s (overlapped); "
            f"K/V {s.kv_bytes / GIB:,.2f} GiB {s.kv_s:.3f} s",
            f"  step {s.step_s:.3f} s, {s.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"{lay.max_steps} steps in {s.wall_s / 3600:,.2f} h",
        ]
        if lay.context_parallel > 1:
            lines.append(
                f"  context parallel balance={lay.context_parallel_balance}: expected attention "
                f"work imbalance {s.cp_work_imbalance:.3f} (max / mean over ranks; counted in "
                "the step time: the ranks wait for the slowest at every layer)"
            )
    lines += [f"  {n}" for n in plan.notes]
    return "\n".join(lines)


def phases_note(term: Term) -> str:
    return f"[{' / '.join(term.phases)} backward only]" if term.phases else ""


def plan_dict(plan: Plan) -> dict:
    return {
        "layout": dataclasses.asdict(plan.layout),
        "device": dataclasses.asdict(plan.device),
        "terms_bytes": {t.name: t.bytes for t in plan.terms},
        "total_bytes": plan.total_bytes,
        "fits": plan.fits,
        "largest_term": plan.largest.name,
        "activations_per_layer_bytes": plan.activations_per_layer,
        "suggestion": plan.suggestion_change or None,
        "step": None if plan.step is None else dataclasses.asdict(plan.step),
    }
