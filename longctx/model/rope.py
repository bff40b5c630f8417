"""Rotary position embeddings driven by each token's position id (reset or continuous).

The rotation pairs dimension i with i + D/2 ("rotate half"), the convention of the Hugging Face
Llama checkpoints, so their wq/wk load without a permutation. Frequencies are computed in fp32
exactly as those checkpoints were trained; cos/sin are built once per forward for the batch's
positions and shared by every layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from longctx.errors import LongctxError
from longctx.model.validation import require_number, require_positive, require_positive_int

ROPE_TYPES = ("llama3", "linear", "yarn")
LLAMA3_ORIGINAL_LENGTH = 8192  # Llama 3's pre-training length, where Llama 3.1's scaling starts


@dataclasses.dataclass
class RopeScaling:
    """RoPE frequency scaling for a context longer than the original training length.

    ``type`` picks the method, each as transformers implements it for ``rope_type``:
    - ``llama3`` (Llama 3.1): short wavelengths kept, long ones divided by ``factor``, a smooth
      band between ``low_freq_factor`` and ``high_freq_factor`` (in original-length units);
    - ``linear`` (position interpolation): every frequency divided by ``factor``;
    - ``yarn``: frequencies ramped from kept (more than ``beta_fast`` rotations over the original
      length) to divided (fewer than ``beta_slow``), and cos/sin multiplied by the attention
      temperature ``attention_factor`` (default 0.1 ln(factor) + 1).
    Fields of another type are ignored.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # the length the model was trained at (llama3, yarn). None: llama3's own 8192 (Llama 3's
    # pre-training length, which that method is defined for); yarn has no default, since its ramp
    # is placed by the extended model's own training length
    original_max_position: int | None = None
    type: str = "llama3"
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = 0.1 ln(factor) + 1
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise LongctxError(
                f"rope_scaling.type={self.type!r} is unknown; expected one of {ROPE_TYPES}"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            require_number(f"rope_scaling.{name}", getattr(self, name))  # used by its type or not
        if self.factor <= 1:
            raise LongctxError(
                f"rope_scaling.factor={self.factor}; expected a factor > 1 (the context is "
                "extended by it; for none, set rope_scaling to null)"
            )
        if self.original_max_position is None:
            self.original_max_position = self._default_original_length()
        require_positive_int("rope_scaling.original_max_position", self.original_max_position)
        if self.type == "llama3":
            self._check_llama3()
        elif self.type == "yarn":
            self._check_yarn()

    def _default_original_length(self) -> int:
        if self.type == "yarn":
            raise LongctxError(
                "rope_scaling.original_max_position is not set; yarn places its ramp by the "
                "length the model was trained at: set it (e.g. "
                "model.rope_scaling.original_max_position=8192 for a model trained at 8k)"
            )
        return LLAMA3_ORIGINAL_LENGTH  # linear ignores it

    def _check_llama3(self) -> None:
        for name in ("low_freq_factor", "high_freq_factor"):
            require_positive(f"rope_scaling.{name}", getattr(self, name))
        if self.high_freq_factor <= self.low_freq_factor:
            raise LongctxError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must be greater than "
                f"low_freq_factor={self.low_freq_factor} (the smooth band lies between them)"
            )

    def _check_yarn(self) -> None:
        for name in ("beta_fast", "beta_slow"):
            require_positive(f"rope_scaling.{name}", getattr(self, name))
        if self.beta_fast <= self.beta_slow:
            raise LongctxError(
                f"rope_scaling.beta_fast={self.beta_fast} must be greater than beta_slow="
                f"{self.beta_slow} (rotations over the original length where YaRN's ramp starts "
                "and ends)"
            )
        if self.attention_factor is not None:
            require_positive("rope_scaling.attention_factor", self.attention_factor)
        if not isinstance(self.truncate, bool):
            raise LongctxError(f"rope_scaling.truncate={self.truncate!r}; expected true or false")

    @property
    def attention_scale(self) -> float:
        """The factor cos and sin are multiplied by (so q.k by its square): YaRN's temperature."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0

    def scale(self, exponents: Tensor, theta: float) -> Tensor:
        """Scaled fp32 inverse frequencies for ``exponents`` 2i/D."""
        inv_freq = 1.0 / (theta**exponents)
        if self.type == "linear":
            return inv_freq / self.factor
        if self.type == "llama3":
            return self._llama3(inv_freq)
        return self._yarn(exponents, theta)

    def _llama3(self, inv_freq: Tensor) -> Tensor:
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        # smooth = 0 at the long-wavelength edge (fully scaled), 1 at the short one (unscaled)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_band, blended, scaled)

    def _yarn(self, exponents: Tensor, theta: float) -> Tensor:
        pos_freqs = theta**exponents
        head_dim = 2 * exponents.numel()
        low, high = (
            self._yarn_dim(rotations, head_dim, theta)
            for rotations in (self.beta_fast, self.beta_slow)
        )
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        dims = torch.arange(head_dim // 2, dtype=torch.float32, device=exponents.device)
        interpolated = ((dims - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: divided
        kept = 1 - interpolated
        return 1.0 / (self.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept

    def _yarn_dim(self, rotations: float, head_dim: int, theta: float) -> float:
        """The (fractional) dimension index that turns ``rotations`` times over the original length."""
        turns = self.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict transformers' LlamaConfig reads for this scaling."""
        out: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        if self.type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position,
            )
        elif self.type == "yarn":
            out.update(
                original_max_position_embeddings=self.original_max_position,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
                truncate=self.truncate,
            )
            if self.attention_factor is not None:  # else transformers derives the same default
                out["attention_factor"] = self.attention_factor
        return out

    @classmethod
    def from_hf(cls, rope: dict[str, Any], max_position: int) -> RopeScaling | None:
        """From a transformers ``rope_scaling`` / ``rope_parameters`` dict; None for 'default'."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ROPE_TYPES:
            raise LongctxError(
                f"unsupported RoPE type {kind!r}; expected 'default' or one of {ROPE_TYPES}"
            )
        needed = (
            ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",)
        )
        missing = [k for k in needed if rope.get(k) is None]
        if missing:
            raise LongctxError(f"RoPE type {kind!r} needs {missing}; got {rope}")
        fields: dict[str, Any] = {"type": kind, "factor": float(rope["factor"])}
        original = rope.get("original_max_position_embeddings", max_position)
        fields["original_max_position"] = int(original)
        if kind == "llama3":
            fields.update(
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
            )
        if kind == "yarn":
            fields.update(_yarn_fields_from_hf(rope, fields["factor"]))
        return cls(**fields)


def _yarn_fields_from_hf(rope: dict[str, Any], factor: float) -> dict[str, Any]:
    """beta_fast / beta_slow (transformers' defaults 32 / 1 when unset) and the attention
    factor, given or derived from DeepSeek's mscale / mscale_all_dim as transformers does."""
    attention = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return dict(
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=None if attention is None else float(attention),
        truncate=bool(rope.get("truncate", True)),
    )


def _mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, device=None
) -> Tensor:
    """fp32 [D/2] inverse frequencies theta^(-2i/D), scaled when ``scaling`` is given."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents) if scaling is None else scaling.scale(exponents, theta)


def rope_cos_sin(
    inv_freq: Tensor,
    position_ids: Tensor,
    dtype: torch.dtype,
    scale: float = 1.0,
    exact_angles: bool = True,
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, L, D/2] in ``dtype`` for the given int position ids [B, L], times ``scale``
    (YaRN's attention temperature; 1 otherwise).

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
    cos, sin = angles_BLF.cos(), angles_BLF.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


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
