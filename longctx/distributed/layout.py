"""How a run's processes are laid out: the world size and the context-parallel split of rows.

``parallel:`` in the config (conf/parallel/) is this module's :class:`ParallelConfig`; Lightning's
own ``trainer:`` node keeps only Lightning's keys, so nothing is taken out of it.
"""

from __future__ import annotations

import dataclasses

from longctx.cp_balance import DEFAULT_BALANCE, check_balance, rank_unit
from longctx.errors import LongctxError


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """``context_parallel``: ranks that split each packed row; it must divide the world size,
    and the remaining factor is data parallel (DDP or FSDP2). ``context_parallel_balance``:
    which tokens of a row each rank holds (longctx.cp_balance: documents,
    head_tail or rounds). ``context_parallel_rounds``: head-tail rounds per row of the
    ``rounds`` balancer (each row is cut into 2 x context_parallel chunks per round)."""

    context_parallel: int = 1
    context_parallel_rounds: int = 1
    context_parallel_balance: str = DEFAULT_BALANCE

    def __post_init__(self) -> None:
        for name in ("context_parallel", "context_parallel_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LongctxError(f"parallel.{name}={value!r}; expected an integer >= 1")
        try:
            check_balance(self.context_parallel_balance, self.context_parallel_rounds)
        except LongctxError as err:
            raise LongctxError(f"parallel: {err}") from err

    @property
    def query_chunks(self) -> int:
        """Equal query chunks each row is cut into, which a backend may need in whole tiles
        (1 without context parallelism)."""
        if self.context_parallel == 1:
            return 1
        return rank_unit(
            self.context_parallel, self.context_parallel_balance, self.context_parallel_rounds
        )


def world_size(devices, num_nodes) -> int | None:
    """devices x num_nodes; None where ``devices`` is Lightning's to count ("auto", a list)."""
    if not isinstance(devices, int) or isinstance(devices, bool):
        return None
    return devices * int(num_nodes)
