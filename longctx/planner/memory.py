"""Per-rank memory of a training step, as a list of named terms in bytes, each derived from
what the code keeps, not from a rule of thumb:

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
"""

from __future__ import annotations

from dataclasses import dataclass

from longctx.model.config import LlamaConfig
from longctx.planner.device import Device
from longctx.planner.layout import RunLayout, size_biased_mean

# fp32 weights (the optimizer's master copy), fp32 gradients, AdamW's two fp32 moments
WEIGHT_BYTES, GRADIENT_BYTES, ADAMW_BYTES = 4, 4, 8
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


def peak_bytes(terms) -> int:
    """Held terms plus the largest backward phase's transient terms."""
    held = sum(t.bytes for t in terms if not t.phases)
    phases = {p for t in terms for p in t.phases}
    return held + max((sum(t.bytes for t in terms if p in t.phases) for p in phases), default=0)


def layer_activation_bytes(config: LlamaConfig, layout: RunLayout, tokens: int) -> int:
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


def ffn_activation_bytes(config: LlamaConfig, layout: RunLayout, tokens: int) -> int:
    """The feed-forward half of :func:`layer_activation_bytes`: its norm's input and 1/rms,
    w1's and w3's input (one copy per linear under autocast) and SwiGLU's four [ffn_dim]
    tensors. Its backward frees them before the attention's backward begins."""
    c, k = config, layout.compute_bytes
    linear_inputs = 2 if layout.precision == "bf16-mixed" else 1
    per_token = c.dim * layout.residual_bytes + 4 + linear_inputs * c.dim * k + 4 * c.ffn_dim * k
    return tokens * per_token


def activation_terms(config: LlamaConfig, layout: RunLayout) -> list[Term]:
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


def ffn_working_bytes(config: LlamaConfig, layout: RunLayout) -> int:
    """Gradients alive at once in the feed-forward's backward, beyond its saved tensors: at
    the SwiGLU product's backward, the gradients of silu's and of w3's outputs ([ffn_dim] each;
    the product's own gradient and saved tensors are freed as they are consumed), and the
    residual stream's gradient with the branch's ([dim] each)."""
    k = layout.compute_bytes
    per_token = 2 * config.ffn_dim * k + 2 * config.dim * layout.residual_bytes
    return layout.tokens_per_rank * per_token


def attention_working_bytes(config: LlamaConfig, layout: RunLayout) -> int:
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


def loss_bytes(config: LlamaConfig, layout: RunLayout) -> int:
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


def gathered_kv_terms(config: LlamaConfig, layout: RunLayout) -> list[Term]:
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


def parameter_terms(config: LlamaConfig, layout: RunLayout) -> list[Term]:
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


def memory_terms(config: LlamaConfig, layout: RunLayout, device: Device) -> list[Term]:
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


def step_tensor_terms(config: LlamaConfig, layout: RunLayout) -> list[Term]:
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
