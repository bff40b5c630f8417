"""The effective-length suite: RULER's 13 tasks (and longctx's own lc_* ones), generated locally.

    instances = make_instances(tokenizer, ["niah_single_1", "vt"], [1024, 2048, 4096])
    results = score_instances(model, instances, scoring="generate", tokenizer=tokenizer)
    report = summarize(results, anchor=2048)  # cells with 95% CIs, RULER's and the relative
                                              # effective length, with bootstrap intervals

The tasks are longctx.synthetic.tasks', their haystacks longctx.synthetic.haystacks' (named by
longctx.data.corpus.resolve_haystack); studies.ruler_report compares the arms of a sweep.
"""

from longctx.eval.ruler.effective_length import (
    relative_effective_length,
    ruler_effective_length,
)
from longctx.eval.ruler.generate import chance, make_instance, make_instances, plan_instances
from longctx.eval.ruler.instances import RulerInputError, tokens_digest, write_instances
from longctx.eval.ruler.metrics import string_match_all, string_match_part
from longctx.eval.ruler.scoring import answer_logits, instance_batch, score_instances, summarize
from longctx.eval.ruler.tables import cell_table, wilson

__all__ = [
    "RulerInputError",
    "answer_logits",
    "cell_table",
    "chance",
    "instance_batch",
    "make_instance",
    "make_instances",
    "plan_instances",
    "relative_effective_length",
    "ruler_effective_length",
    "score_instances",
    "string_match_all",
    "string_match_part",
    "summarize",
    "tokens_digest",
    "wilson",
    "write_instances",
]
