"""The effective-length suite: RULER's 13 tasks (and longctx's own lc_* ones), generated locally.

    instances = make_instances(tokenizer, ["niah_single_1", "vt"], [1024, 2048, 4096])
    results = score_instances(model, instances)           # any model over PackedBatch
    report = summarize(results)                           # cells with 95% CIs, effective length

Modules: ``tasks`` (the names; the generators are longctx.synthetic's), ``instances`` (the
instance, haystacks, JSONL), ``generate`` (instances from names, skips said), ``scoring`` (argmax scoring, CIs, the threshold rule),
``hf`` (any local transformers folder), ``callback`` (in-loop), ``suite`` (the CLI's runner),
and longctx.experiments.ruler_report (arms of a sweep: paired differences, heat maps).
"""

from longctx.eval.ruler.generate import (
    DEFAULT_DEPTHS,
    RULER_TASK_NAMES,
    TASK_NAMES,
    Plan,
    chance,
    check_depth,
    check_tasks,
    make_instance,
    make_instances,
    plan_instances,
)
from longctx.eval.ruler.instances import (
    CorpusHaystack,
    Instance,
    NoiseHaystack,
    RulerInputError,
    resolve_haystack,
    tokens_digest,
    write_instances,
)
from longctx.eval.ruler.scoring import (
    EffectiveLength,
    answer_logits,
    cell_table,
    effective_length,
    instance_batch,
    length_table,
    score_instances,
    suite_effective_length,
    suite_table,
    summarize,
    wilson,
)

__all__ = [
    "DEFAULT_DEPTHS",
    "TASK_NAMES",
    "CorpusHaystack",
    "EffectiveLength",
    "Instance",
    "NoiseHaystack",
    "Plan",
    "RULER_TASK_NAMES",
    "RulerInputError",
    "answer_logits",
    "cell_table",
    "chance",
    "check_depth",
    "check_tasks",
    "effective_length",
    "instance_batch",
    "length_table",
    "make_instance",
    "make_instances",
    "plan_instances",
    "resolve_haystack",
    "score_instances",
    "suite_effective_length",
    "suite_table",
    "summarize",
    "tokens_digest",
    "wilson",
    "write_instances",
]
