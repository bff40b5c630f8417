"""The rows the probe runs on: a run's own first micro-batches of every stage."""

from __future__ import annotations

from longctx.data.datamodule import LongCtxDataModule
from longctx.errors import LongctxError
from longctx.probe.checks import NothingToProbe, ProbeRows

# micro-batches read per stage, at most, looking for rows that hold two documents or more
SCAN_LIMIT = 256


def run_rows(datamodule: LongCtxDataModule, batches: int = 1) -> list[ProbeRows]:
    """Per stage (data.stages; one stage without), the first ``batches`` micro-batches in which
    some row holds two documents or more (rows of one document leave nothing to probe), as
    the run's train stream packs and collates them (stream 0: global micro-batch 0 of the
    stage onwards), with each row's pad tail as the packer counted it. A stage with no such
    micro-batch among its first SCAN_LIMIT gives its first one (its positions and labels are
    still checked)."""
    config = datamodule.config
    if not config.document_mask:
        raise NothingToProbe(
            "nothing to probe (data.document_mask=false): this arm attends across documents by "
            "design; probe the masked arm (data.document_mask=true)"
        )
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise LongctxError(f"batches={batches!r}; expected a positive int of micro-batches")
    stream = datamodule.train_dataset()
    out = []
    for stage in range(len(stream.schedule.configs)):
        found = _stage_rows(stream, stage, batches)
        for i, probed in found:
            b, length = probed.batch.shape
            documents = sum(probed.documents(r) for r in range(b))
            probed.name = f"stage {stage} batch {i} ({b}x{length}, {documents} docs)"
        out += [probed for _, probed in found]
    return out


def _stage_rows(stream, stage: int, batches: int) -> list[tuple[int, ProbeRows]]:
    batch_stream = stream.open_stream(0, stage)  # the stream of the stage's first micro-batch
    first, found = None, []
    for i in range(SCAN_LIMIT):
        rows = batch_stream.next_rows()
        probed = ProbeRows(batch_stream.collate(rows), [row.pad_tokens for row in rows])
        first = first or (i, probed)
        if max(row.documents for row in rows) >= 2:
            found.append((i, probed))
            if len(found) == batches:
                break
    return found or [first]
