"""The suite's tasks: RULER's 13 under RULER's names and longctx's own ``lc_*`` formats.

The generators live in longctx.synthetic (shared with the training-data synthesizer); this
module names what the suite reads from there.
"""

from longctx.synthetic.legacy import DIGITS
from longctx.synthetic.tasks import RULER_TASKS, STRING_MATCH_ALL, STRING_MATCH_PART, TASKS, Task

__all__ = ["DIGITS", "RULER_TASKS", "STRING_MATCH_ALL", "STRING_MATCH_PART", "TASKS", "Task"]
