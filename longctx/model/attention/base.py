"""The interface every attention backend implements (one object per backend, see the registry
in longctx.model.attention)."""

from __future__ import annotations

import torch
from torch import Tensor

from longctx.batch import PackedBatch
from longctx.cp_balance import DOCUMENTS
from longctx.errors import LongctxError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AttentionBackend:
    """One backend. ``metadata`` takes a PackedBatch or a ContextShard; ``attend`` runs a
    whole-row batch, ``attend_row`` a shard's queries against the gathered rows' keys."""

    name: str
    # context parallelism with a plan of documents (balance="documents"): the backend builds
    # its metadata from each rank's own pieces and their key spans, not from equal chunks
    per_rank_key_spans: bool = False

    def check(
        self, device: torch.device, seq_len: int, *, chunks: int = 1, training: bool = False
    ) -> None:
        """Refuse what this backend cannot run, saying why: rows of ``seq_len`` keys on
        ``device``, cut into ``chunks`` query chunks (context parallelism), with gradients
        when ``training``. The model checks at every forward; the app's preflight asks too."""

    def check_context_parallel(self, balance: str) -> None:
        """Refuse a context-parallel balancer whose shards this backend cannot attend."""
        if balance == DOCUMENTS and not self.per_rank_key_spans:
            raise LongctxError(
                f"context_parallel_balance={DOCUMENTS!r} needs an attention backend that takes "
                f"per-rank key spans; attn_backend={self.name!r} does not: use "
                "context_parallel_balance=head_tail or rounds with it"
            )

    def check_device(self, device: torch.device) -> None:
        """Refuse a device this backend cannot run on (resolve_backend asks first)."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in FLOAT_DTYPES:
            raise LongctxError(f"attention got dtype {dtype}; expected one of {FLOAT_DTYPES}")

    def metadata(self, batch: PackedBatch):
        raise NotImplementedError

    def attend(self, q: Tensor, k: Tensor, v: Tensor, data) -> Tensor:
        raise NotImplementedError

    def attend_row(
        self, q: Tensor, k: Tensor, v: Tensor, k_row: Tensor, v_row: Tensor, data
    ) -> Tensor:
        raise NotImplementedError
