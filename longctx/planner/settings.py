"""The planner's stated numbers, its error, and the ``planner`` config group (conf/train.yaml)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longctx.errors import LongctxError
from longctx.model.validation import require_positive

GIB = 2**30
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
# NVLink 4 all-gather bus bandwidth within a node; one 400 Gb/s NIC per GPU between nodes
INTRA_NODE_BYTES_PER_S = 360e9
INTER_NODE_BYTES_PER_S = 45e9
# no GPU MFU has been measured in this project yet: a stated assumption (set planner.mfu)
DEFAULT_MFU = 0.40


class PlanError(LongctxError):
    """A planning input that is missing or cannot work; the message names the key to set."""


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
                "planner.device_memory_gb",
                self.device_memory_gb,
                PlanError,
                "the memory of one device",
            )
        require_positive("planner.mfu", self.mfu, PlanError, "the model FLOPs utilisation")
        if self.mfu > 1:
            raise PlanError(f"planner.mfu={self.mfu}; expected a fraction in (0, 1]")
        for key in ("intra_node_gb_per_s", "inter_node_gb_per_s"):
            bandwidth = "the collective bandwidth per GPU"
            require_positive(f"planner.{key}", getattr(self, key), PlanError, bandwidth)
        if self.doc_length_median is not None:
            require_positive(
                "planner.doc_length_median",
                self.doc_length_median,
                PlanError,
                "the median document length",
            )
        require_positive(
            "planner.doc_length_sigma",
            self.doc_length_sigma,
            PlanError,
            "the document length spread",
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
