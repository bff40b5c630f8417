"""Synthetic long-context tasks: generators, haystacks, templates and their assembly into tokens.

Shared by the training-data synthesizer (longctx.data.synthesize) and the effective-length
suite (longctx.eval.ruler), below both: nothing here imports ``data`` or ``eval``.

- ``pieces``: encoding (each piece on its own, memoised), listings, the errors;
- ``layout``: a task's layout (head, needles at depths, question, answer) and its assembly
  into exactly ``n`` prompt tokens, needles inserted between haystack units (sentences);
- ``haystacks``: RULER's noise sentence, the legacy filler and sentences of a text;
- ``words``: keys and values (wonderwords' adjective-noun pairs, 7-digit numbers, uuids);
- ``ruler``: RULER's 13 tasks under RULER's names, its templates verbatim;
- ``qa``: SQuAD / HotpotQA folders in RULER's JSON form;
- ``legacy``: longctx's own formats (``lc_passkey``, ``lc_copy``, ...), named so as not to claim
  RULER's.
"""

from longctx.synthetic.haystacks import FillerHaystack, NoiseHaystack, TextHaystack
from longctx.synthetic.layout import Draw, Layout, assemble
from longctx.synthetic.pieces import DoesNotFit, Encoder, RunsOut, TaskInputError, cat, listing
from longctx.synthetic.tasks import TASKS, Task

__all__ = [
    "TASKS",
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
