"""Incremental decoding: a KV cache and the attention of new queries against it.

Prefill runs the prompt rows through the model's normal attention (any backend, a
PackedBatch or a context-parallel shard of one) and keeps every layer's keys and values
(RoPE applied). Each decoding step then appends the new tokens' keys and values and
attends their queries to the cache. The token being generated continues the row's LAST
segment, so it sees the keys from that segment's start up to itself, as it would in a full
recompute of the row with the new tokens appended to that segment.

The mask is [B, T, S] for T new queries over S cached keys: one row of the cache per new
token (T = 1 when decoding), never an L x L mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longctx.model.attention.sdpa import _gqa


class KVCache:
    """Per layer keys and values [B, capacity, Hkv, D] of the rows decoded so far.

    ``length``: the positions filled (the same for every row). ``key_start`` [B]: where each
    row's last segment (the document being continued) starts. ``next_position`` [B]: the
    position id of each row's next token. The buffers are allocated by the first write,
    in the dtype and on the device of the keys written.
    """

    def __init__(self, n_layers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KV cache capacity={capacity}; expected >= 1 positions")
        self.capacity = capacity
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.length = 0
        self.key_start: Tensor | None = None
        self.next_position: Tensor | None = None

    def extend(self, layer: int, k_BTKD: Tensor, v_BTKD: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``layer``'s new keys and values after the filled positions; the filled
        keys and values including them, [B, length + T, Hkv, D] views."""
        end = self.length + k_BTKD.shape[1]
        if end > self.capacity:
            raise ValueError(
                f"KV cache holds {self.capacity} positions; {end} needed (the prompt plus the "
                "tokens generated): allocate it with a larger capacity"
            )
        if self.keys[layer] is None:
            b, _, heads, d = k_BTKD.shape
            shape = (b, self.capacity, heads, d)
            self.keys[layer] = k_BTKD.new_empty(shape)
            self.values[layer] = v_BTKD.new_empty(shape)
        self.keys[layer][:, self.length : end] = k_BTKD
        self.values[layer][:, self.length : end] = v_BTKD
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, new_tokens: int) -> None:
        """Every layer has written ``new_tokens`` more positions."""
        self.length += new_tokens
        self.next_position = self.next_position + new_tokens

    def positions(self, new_tokens: int) -> Tensor:
        """int64 [B, new_tokens]: the position ids of the next tokens."""
        if self.next_position is None:
            raise ValueError("the KV cache is empty: prefill the prompt before decoding")
        steps = torch.arange(new_tokens, device=self.next_position.device)
        return self.next_position[:, None] + steps


def cached_attention(q_BTHD: Tensor, k_BSKD: Tensor, v_BSKD: Tensor, key_start_B: Tensor) -> Tensor:
    """The T newest tokens' queries against the S cached keys (the T last of them their own):
    query t (row position S - T + t) sees keys key_start .. S - T + t. -> [B, T, H, D]."""
    t, s = q_BTHD.shape[1], k_BSKD.shape[1]
    keys = torch.arange(s, device=q_BTHD.device)
    query_pos = torch.arange(s - t, s, device=q_BTHD.device)
    causal_TS = keys[None, :] <= query_pos[:, None]
    in_document_BS = keys[None, :] >= key_start_B.to(keys.device)[:, None]
    mask_B1TS = (causal_TS[None] & in_document_BS[:, None])[:, None]
    q, k, v = (x.transpose(1, 2) for x in (q_BTHD, k_BSKD, v_BSKD))  # [B, heads, len, D]
    k, v, gqa_kwargs = _gqa(q, k, v)
    out_BHTD = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS, **gqa_kwargs)
    return out_BHTD.transpose(1, 2)
