"""Rotary position embeddings driven by each token's position id (reset or continuous).

The rotation pairs dimension i with i + D/2 ("rotate half"), the convention of the Hugging Face
Llama checkpoints, so their wq/wk load without a permutation. Frequencies are computed in fp32
exactly as those checkpoints were trained; cos/sin are built once per forward for the batch's
positions and shared by every layer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from longctx.model.config import RopeScaling


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device=None
) -> Tensor:
    """fp32 [D/2] inverse frequencies theta^(-2i/D), with Llama 3.1 scaling when given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else llama3_scale(inv_freq, scaling)


def llama3_scale(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3.1: keep short wavelengths, divide long ones by ``factor``, blend in between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    # smooth = 0 at the long-wavelength edge (fully scaled), 1 at the short one (unscaled)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    inv_freq: Tensor, position_ids: Tensor, dtype: torch.dtype, exact_angles: bool = True
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, L, D/2] in ``dtype`` for the given int position ids [B, L].

    ``exact_angles``: the angle ``position * inv_freq`` in fp64, where the product of an int
    position (< 2^29) and an fp32 frequency is exact, so cos/sin round once, to ``dtype``. In
    fp32 (transformers' way) the product itself rounds: near position 131,071 that is an error
    of a few 1e-3 rad in the fast frequencies, while a reset row's short positions rotate almost
    exactly -- the only thing that separates reset from continuous positions under document
    masking (benchmarks/bench_rope_angles.py).
    """
    inv_freq = inv_freq.to(position_ids.device)
    if exact_angles:
        angles_BLF = position_ids.double().unsqueeze(-1) * inv_freq.double()
    else:
        angles_BLF = position_ids.float().unsqueeze(-1) * inv_freq
    return angles_BLF.cos().to(dtype), angles_BLF.sin().to(dtype)


def apply_rope(x_BLHD: Tensor, cos_BLF: Tensor, sin_BLF: Tensor) -> Tensor:
    """Rotate each (x_i, x_{i+D/2}) pair by its position's angle for frequency i."""
    # in x's dtype: under autocast q/k are bf16 while cos/sin follow the fp32 residual stream,
    # and promoting q/k to fp32 here would hand fp32 to attention kernels that refuse it
    cos = cos_BLF.unsqueeze(2).to(x_BLHD.dtype)  # broadcast over heads
    sin = sin_BLF.unsqueeze(2).to(x_BLHD.dtype)
    return _Rotate.apply(x_BLHD, cos, sin)


class _Rotate(torch.autograd.Function):
    """A rotation whose backward is the inverse rotation of the gradient.

    Autograd through the plain formula would save x's halves and run a chain of muls, a cat
    and its split per q/k per layer; here only cos/sin (shared by every layer) are kept and
    each direction is four fused ops writing straight into the output's halves.
    """

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, inverse=True), None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); sin negated when ``inverse``."""
    sign = -1.0 if inverse else 1.0
    x1, x2 = x.chunk(2, dim=-1)
    if torch.compiler.is_compiling():  # Inductor fuses this itself and cannot trace out= ops
        return torch.cat((x1 * cos - sign * x2 * sin, x2 * cos + sign * x1 * sin), dim=-1)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-sign)
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin, value=sign)
    return out
