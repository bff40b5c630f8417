"""Synthetic long-context tasks: generators, haystacks, templates and their assembly into tokens.

Shared by the training-data synthesizer (longctx.data.synthesize), the effective-length suite
(longctx.eval.ruler), the held-out answer loss and the recall study, below them all: nothing
here imports ``data`` or ``eval``.

- ``tasks``: the one registry of tasks by name (``TASKS``), their families and readers;
- ``pieces``: encoding (each piece on its own, memoised), listings, the errors;
- ``layout``: a task's layout (head, needles at depths, question, answer) and its assembly
  into exactly ``n`` prompt tokens, needles inserted between haystack units (sentences);
- ``haystacks``: every haystack: RULER's noise sentence, the lc_* filler, sentences of a text
  or of a corpus;
- ``words``: keys and values (wonderwords' adjective-noun pairs, 7-digit numbers, uuids);
- ``ruler``: RULER's 13 tasks under RULER's names, its templates verbatim;
- ``qa``: SQuAD / HotpotQA folders in RULER's JSON form;
- ``lc_formats``: longctx's own formats (``lc_passkey``, ``lc_copy``, ...), named so as not to
  claim RULER's;
- ``dense``: the dense training tasks (``kv_recall``, ``copy``, ``repeat``);
- ``ood``: training tasks in formats the suite never uses (``ood_*``);
- ``mqar``: multi-query associative recall, one token per key.
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
