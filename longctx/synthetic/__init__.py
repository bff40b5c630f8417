"""Synthetic long-context tasks: generators, haystacks, templates and their assembly into tokens.

Shared by the training-data synthesizer (longctx.data.synthesize), the effective-length suite
(longctx.eval.ruler), the held-out answer loss and the recall study, below them all: nothing
here imports ``data`` or ``eval``. ``tasks`` is the one registry of tasks by name.
"""

from longctx.synthetic.haystacks import CorpusHaystack, FillerHaystack, NoiseHaystack, TextHaystack
from longctx.synthetic.layout import Draw, Layout, assemble
from longctx.synthetic.pieces import DoesNotFit, Encoder, RunsOut, TaskInputError, cat, listing
from longctx.synthetic.tasks import TASKS, Task

__all__ = [
    "TASKS",
    "CorpusHaystack",
    "DoesNotFit",
    "Draw",
    "Encoder",
    "FillerHaystack",
    "Layout",
    "NoiseHaystack",
    "RunsOut",
    "Task",
    "TaskInputError",
    "TextHaystack",
    "assemble",
    "cat",
    "listing",
]
