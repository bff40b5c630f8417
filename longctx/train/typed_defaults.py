"""The typed configs' defaults as Hydra nodes: each setting has one source.

A conf/ file that fills a typed config (a dataclass, or the class or function its ``_target_``
names) writes only what differs from that config's own defaults; its defaults list puts the
rest in place from here, e.g. conf/data/default.yaml::

    defaults:
      - /typed_defaults/DataConfig@_here_
      - _self_

so every setting keeps its key in the composed config (``data.num_workers=2`` overrides it
without a ``+``; the run record and a resume see every value) while its value is written once,
in the config's definition. :func:`register` stores the nodes; it runs before Hydra composes
(longctx.train.resolvers.register_with_hydra: train.py, the probe's CLI, the tests' compose).
tests/unit/test_config_sources.py holds every conf/ file to this.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_object

from longctx.model.config import PRESETS, LlamaConfig

GROUP = "typed_defaults"

# the typed configs conf/ fills, by dotted path (as a _target_ names them: the probe's callback
# lives in a layer above this one), each with its parameters that are no setting (what the
# config's owner sets itself, or a factory with a node of its own)
TYPED_CONFIGS: dict[str, tuple[str, ...]] = {
    "longctx.data.DataConfig": ("bos_id", "answer_keys"),  # set by the datamodule
    "longctx.distributed.layout.ParallelConfig": (),
    "longctx.hf.HFModelSpec": (),
    "longctx.train.optim_config.OptimConfig": ("scheduler",),  # optim.scheduler: its own node
    "longctx.planner.PlannerSettings": (),
    "longctx.distributed.fsdp.FSDP2Strategy": (),
    "longctx.train.callbacks.SaveOnSignal": (),
    "longctx.eval.callbacks.LongDocumentLoss": (),
    "longctx.eval.callbacks.PositionLossCurves": (),
    "longctx.eval.callbacks.HeldOutDocumentLoss": (),
    "longctx.eval.answer_loss.HeldOutAnswerLoss": (),
    "longctx.eval.ruler.callback.RulerEval": (),
    "longctx.probe.callback.LeakProbe": (),
}

# what a run sets on a Llama preset (model.<key>=...); a key some preset sets defaults to null,
# which LlamaConfig.from_name reads as the preset's value. The presets' shapes are not run
# settings: +model.<field>=... sets one
LLAMA_RUN_SETTINGS = (
    "attn_backend",
    "activation_checkpointing",
    "loss_chunk_size",
    "rope_theta",
    "rope_scaling",
    "init_from",
)
LLAMA_NODE = "LlamaConfig"


def node_name(path: str) -> str:
    """The node of a dotted path: its class's name (``/typed_defaults/DataConfig``)."""
    return path.rsplit(".", 1)[-1]


def parameter_defaults(target: Any) -> dict[str, Any]:
    """Every parameter of ``target`` (a dataclass, a class, a function) that has a default,
    with that default as a config value."""
    if dataclasses.is_dataclass(target):
        return {
            f.name: config_value(
                f.default_factory() if f.default is dataclasses.MISSING else f.default
            )
            for f in dataclasses.fields(target)
            if f.init and (f.default, f.default_factory) != (dataclasses.MISSING,) * 2
        }
    return {
        name: config_value(p.default)
        for name, p in inspect.signature(target).parameters.items()
        if p.default is not inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def config_value(value: Any) -> Any:
    """A default as the config spells it (a tuple is a list); what no config holds is refused."""
    if isinstance(value, tuple | list):
        return [config_value(v) for v in value]
    if isinstance(value, dict):
        return {k: config_value(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a default of {value!r} has no config spelling")


def llama_run_defaults() -> dict[str, Any]:
    preset_keys = set().union(*PRESETS.values())
    defaults = parameter_defaults(LlamaConfig)
    return {k: None if k in preset_keys else defaults[k] for k in LLAMA_RUN_SETTINGS}


def nodes() -> dict[str, dict[str, Any]]:
    """Every node by name: each typed config's settings at their defaults."""
    found = {}
    for path, not_settings in TYPED_CONFIGS.items():
        defaults = parameter_defaults(get_object(path))
        found[node_name(path)] = {k: v for k, v in defaults.items() if k not in not_settings}
    return found | {LLAMA_NODE: llama_run_defaults()}


def register() -> None:
    store = ConfigStore.instance()
    for name, node in nodes().items():
        store.store(group=GROUP, name=name, node=node)
