"""The config classes a run's stored record may name: the allow-list every reader of a record
passes to longctx.runs.record (which imports no config class itself).

It lives in hf, the lowest package that knows every model spec: longctx's Llama
(longctx.model) and any HF causal LM (this package's HFModelSpec); the data config is
longctx.data's. The keys are the conf/ groups' own ``_target_``s.
"""

from __future__ import annotations

from longctx.data.config import DataConfig
from longctx.hf.adapter import HFModelSpec
from longctx.model.config import LlamaConfig
from longctx.runs.record import RecordTargets

CONFIG_TARGETS = RecordTargets(
    model={
        "longctx.model.LlamaConfig.from_name": LlamaConfig.from_name,
        "longctx.model.LlamaConfig": LlamaConfig,
        "longctx.hf.HFModelSpec": HFModelSpec,
    },
    data={"longctx.data.DataConfig": DataConfig},
)
