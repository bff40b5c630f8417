"""Bad input and bad numbers (#29), in process: every float finite or refused, the non-finite
step guard, init_from's bad weights and files, the smaller holes of data and planner settings,
and the CPU plan's retained-heap allowance. tests/e2e/test_hostile_runs.py runs train.py for the
cases that need a run (a NaN mid-run, the step axis, the console).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, compose
from lightning.pytorch.loggers import Logger
from module_fixtures import SMALL

from longctx import planner
from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.config import Stage
from longctx.hf.weight_source import InitFromError, resolve
from longctx.model import Llama, LlamaConfig
from longctx.train.app import main, run
from longctx.train.module import load_init_weights
from longctx.train.nonfinite import NonFiniteGuard, NonFiniteStep
from longctx.train.preflight import (
    ConfigError,
    check_planner,
    init_from_note,
    non_finite_options,
    unreached_stages,
)


# ------------------------------------------------------------------ finite or refused
@pytest.mark.parametrize(
    "override, names",
    [
        ("model.rope_theta=nan", "rope_theta=nan; expected a finite number"),
        ("model.rope_theta=inf", "rope_theta=inf; expected a finite number"),
        ("model.rope_scaling={factor: nan}", "rope_scaling.factor=nan; expected a finite number"),
        ("+model.norm_eps=inf", "norm_eps=inf; expected a finite number"),
        ("optim.optimizer.lr=inf", "optim.optimizer.lr=inf: not a finite number"),
        ("optim.grad_clip=nan", "optim.grad_clip=nan: not a finite number"),
        ("data.weights=[inf]", "DataConfig.weights=[inf]; expected finite non-negative weights"),
        ("planner.mfu=nan", "planner.mfu=nan: not a finite number"),
        ("planner.intra_node_gb_per_s=0", "planner.intra_node_gb_per_s=0: the collective"),
        ("+planner.intra_node_gbps=100", "planner.intra_node_gbps: unknown planner setting"),
        (
            "model.rope_scaling={type: yarn, factor: 4}",
            "rope_scaling.original_max_position is not set; yarn places its ramp",
        ),
    ],
)
def test_bad_numbers_are_refused_before_training(override, names, tmp_path):
    cfg = compose([*FAST, override], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=re.escape(names)):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists()


# what the command line cannot show as a number: an interpolation resolves to one only when read
INF, NAN = '${oc.decode:"inf"}', '${oc.decode:"nan"}'
RULER = [
    "callbacks=ruler",
    "callbacks.ruler.tasks=[niah_single_1]",
    "callbacks.ruler.lengths=[256]",
]


@pytest.mark.parametrize(
    "overrides, names",
    [
        ([f"optim.scheduler.warmup_steps={INF}"], "optim.scheduler.warmup_steps=inf: not a finite"),
        ([f"optim.optimizer.eps={INF}"], "optim.optimizer.eps=inf: not a finite number"),
        (
            [*RULER, f"callbacks.ruler.every_n_validations={NAN}"],
            "callbacks.ruler.every_n_validations=nan: not a finite number",
        ),
        # an int option given another number; a float option given a string
        (
            ["optim.scheduler.warmup_steps=1.5"],
            "optim.scheduler.warmup_steps=1.5; expected an int "
            "(longctx.train.module.warmup_cosine_schedule's warmup_steps)",
        ),
        (["trainer.max_steps=2.5"], "trainer.max_steps=2.5; expected an int"),
        (["trainer.max_steps=true"], "trainer.max_steps=True; expected an int"),
        (["optim.optimizer.lr='inf'"], "optim.optimizer.lr='inf'; expected a number"),
        (["optim.optimizer.betas=[0.9,'x']"], "betas=[0.9, 'x']; expected a list whose every"),
        (
            [*RULER, "callbacks.ruler.every_n_validations=1.5"],
            "callbacks.ruler.every_n_validations=1.5; expected an int",
        ),
        ([*RULER, "callbacks.ruler.batch_size=1.5"], "callbacks.ruler.batch_size=1.5; expected an"),
        ([*RULER, "callbacks.ruler.batch_size=0"], "callbacks.ruler: batch_size=0; expected a pos"),
        ([*RULER, "callbacks.ruler.batch_size=-1"], "callbacks.ruler: batch_size=-1; expected a"),
        ([*RULER, "callbacks.ruler.samples=0"], "callbacks.ruler: samples=0; expected a positive"),
        (["optim.optimizer.lr=${nope}"], "optim.optimizer.lr: Interpolation key 'nope' not found"),
        (
            ["optim.optimizer.lr=${oc.env:LONGCTX_UNSET_VARIABLE}"],
            "optim.optimizer.lr: Environment variable 'LONGCTX_UNSET_VARIABLE' not found",
        ),
        (["optim.optimizer._target_=3"], "optim.optimizer._target_=3 cannot be imported"),
        # a switch given a count: 1 == True, so `add_bos in (None, True, False)` let it through
        (["data.add_bos=1"], "data.add_bos=1; expected true or false"),
    ],
)
def test_numbers_are_checked_as_resolved_however_they_arrive(overrides, names, tmp_path):
    """Every number of the resolved config, before anything trains: one that arrives through an
    interpolation is checked as one typed in (an infinite warm-up trained at lr 0; a NaN
    every_n_validations turned the suite off), and an int option takes only an int (1.5 ran
    the suite at every third validation)."""
    cfg = compose([*FAST, *overrides], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=re.escape(names)):
        run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, said",
    [
        ("optim.optimizer.lr='inf'", "error: optim.optimizer.lr='inf'; expected a number"),
        ("+callbacks.extra.every_n=2", "error: callbacks.extra has no _target_ ({'every_n': 2})"),
        (
            "+callbacks.extra._target_=builtins.dict",
            "error: callbacks.extra._target_=builtins.dict",
        ),
        (
            "+trainer.accumulate_grad_batches=2",
            "error: trainer.accumulate_grad_batches=2: longctx's training step does this itself "
            "(Lightning's cannot run with it); set optim.accumulate_grad_batches instead",
        ),
    ],
)
def test_config_mistakes_that_were_tracebacks_are_one_line(override, said, tmp_path, capsys):
    """train.py's entry (longctx.train.app.main) with what Lightning, torch or Hydra raised
    tracebacks for; tests/e2e/test_hostile_runs.py runs train.py itself for two more."""
    with pytest.raises(SystemExit) as stopped:
        main(compose([*FAST, override], output_dir=tmp_path / "run"))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(said), err


def test_the_typed_configs_refuse_non_finite_fields():
    for field in ("rope_theta", "norm_eps", "init_std"):
        with pytest.raises(ValueError, match=f"{field}=nan; expected a finite number"):
            LlamaConfig.from_name("tiny", **{field: float("nan")})
    with pytest.raises(ValueError, match=r"rope_scaling.beta_fast=inf"):  # unused by llama3 too
        LlamaConfig.from_name("tiny", rope_scaling={"factor": 8.0, "beta_fast": float("inf")})
    with pytest.raises(ValueError, match="DataConfig.weights"):
        DataConfig(weights=[float("nan")])
    with pytest.raises(
        planner.PlanError, match=r"inter_node_bytes_per_s \(planner.inter_node_gb_per_s x 1e9\)=inf"
    ):
        planner.Device("gpu", 10**9, 1e12, 0, "", inter_node_bytes_per_s=float("inf"))
    with pytest.raises(planner.PlanError, match="peak_flops_per_device=nan"):
        planner.Device("gpu", 10**9, float("nan"), 0, "")
    assert list(non_finite_options({"a": [1.0, {"b": float("-inf")}], "c": "nan"})) == [
        ("a[1].b", float("-inf"))
    ]  # the string "nan" is a string; the tree walked is the resolved config


def test_llama3_keeps_its_original_length_and_yarn_needs_one():
    assert LlamaConfig.from_name("tiny", rope_scaling={"factor": 8.0}).rope_scaling == (
        LlamaConfig.from_name("llama3_8b").rope_scaling
    )
    with pytest.raises(ValueError, match="original_max_position is not set"):
        LlamaConfig.from_name("tiny", rope_scaling={"type": "yarn", "factor": 4.0})
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position": 4096}
    assert LlamaConfig.from_name("tiny", rope_scaling=yarn).rope_scaling.original_max_position == (
        4096
    )


def test_nonfinite_guard_skips_up_to_the_allowance_in_total_then_stops():
    guard = NonFiniteGuard(allowed=2)
    assert guard.check(1, 2.5, 1.0) is None
    assert "step 2: loss nan" in guard.check(2, float("nan"), 1.0)
    assert guard.check(3, 2.4, 1.0) is None  # a finite step between: the count is a total
    assert "2 of optim.skip_nonfinite=2" in guard.check(4, 2.4, float("inf"))
    with pytest.raises(NonFiniteStep, match=r"step 5: loss nan.*after skipping 2"):
        guard.check(5, float("nan"), float("nan"))
    with pytest.raises(NonFiniteStep, match=r"step 1: .*\(optim.skip_nonfinite=0\)"):
        NonFiniteGuard().check(1, float("inf"), 1.0)
    with pytest.raises(ValueError, match="optim.skip_nonfinite=-1"):
        NonFiniteGuard(-1)


# ------------------------------------------------------------------ init_from
def small_llama_checkpoint(path: Path, poison: str | None = None) -> Path:
    """A longctx checkpoint file of the SMALL Llama; ``poison``: a tensor set to NaN."""
    torch.manual_seed(0)
    state = Llama(LlamaConfig.from_name("tiny", **SMALL)).state_dict()
    if poison:
        state[poison].view(-1)[3] = float("nan")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}}, path)
    return path


def init_from(path) -> Llama:
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name("tiny", **SMALL, init_from=str(path)))
    load_init_weights(model, "cpu")
    return model


def test_init_from_weights_with_nan_are_refused_naming_the_tensor(tmp_path):
    init_from(small_llama_checkpoint(tmp_path / "good.ckpt"))  # finite: loads
    bad = small_llama_checkpoint(tmp_path / "bad.ckpt", poison="layers.1.feed_forward.w2.weight")
    with pytest.raises(InitFromError, match=r"NaN or infinite values in layers.1.feed_forward.w2"):
        init_from(bad)


def test_truncated_safetensors_names_the_file(tmp_path):
    import transformers

    folder = tmp_path / "hf"
    hf = transformers.LlamaConfig(
        vocab_size=SMALL["vocab_size"], hidden_size=SMALL["dim"], intermediate_size=SMALL["ffn_dim"],
        num_hidden_layers=SMALL["n_layers"], num_attention_heads=SMALL["n_heads"],
        num_key_value_heads=SMALL["n_kv_heads"], max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(InitFromError, match=r"model.safetensors cannot be read as safetensors"):
        resolve(folder)


def test_a_run_folder_with_an_empty_last_ckpt_says_so(tmp_path):
    run_dir = tmp_path / "run"
    small_llama_checkpoint(run_dir / "checkpoints" / "step=2.ckpt")
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(InitFromError, match=r"last.ckpt' is empty \(0 bytes\).*e.g. step=2.ckpt"):
        resolve(run_dir)


def test_init_from_with_a_resume_says_which_wins():
    assert init_from_note("/runs/a", None) is None  # a fresh start reads init_from
    assert init_from_note(None, "/runs/b/checkpoints/last.ckpt") is None
    note = init_from_note("/runs/a", "/runs/b/checkpoints/last.ckpt")
    assert "model.init_from=/runs/a does not apply: this start resumes /runs/b" in note


# ------------------------------------------------------------------ data
def test_a_parquet_text_column_of_ints_names_file_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from longctx.data.sources import describe_source, read_documents

    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: column 'text' has type int64"):
        list(read_documents(describe_source(path)))


def test_convert_refuses_a_validation_split_that_came_out_empty(tmp_path):
    from test_data_convert import write_megatron

    from longctx.data.convert import convert
    from longctx.data.shards import Vocabulary

    prefix = tmp_path / "corpus"
    write_megatron(prefix, [[np.arange(1, 9)] for _ in range(5)])
    vocab = Vocabulary(vocab_size=64, eos_id=0, pad_id=0, spec={"kind": "stated"})
    with pytest.raises(ValueError, match=r"val-fraction 0.01 put 0 of its 5 documents in the val"):
        convert(prefix, tmp_path / "out", vocab)
    manifest = convert(prefix, tmp_path / "out", vocab, val_fraction=0.0)  # none, as asked
    assert manifest.splits["train"].documents == 5 and manifest.splits["val"].documents == 0


def test_prepare_refuses_a_validation_split_that_came_out_empty(tmp_path):
    import json

    from longctx.data.prepare import prepare

    src = tmp_path / "five.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match=r"val-fraction 0.01 put 0 of its 5 documents in the val"):
        prepare([src], tmp_path / "out", "byte", workers=1, progress=False)
    manifest = prepare([src], tmp_path / "out", "byte", workers=1, val_fraction=0.0, progress=False)
    assert manifest.splits["train"].documents == 5 and manifest.splits["val"].documents == 0


def test_stages_resumed_with_other_micro_batches_per_step_say_why(tmp_path):
    from data_fixtures import small_corpus, take

    folder = small_corpus(tmp_path, 200)
    config = dict(shards=[str(folder)], seq_len=64, micro_batch_size=2, buffer_size=8)
    staged = DataConfig(**config, chunk_documents=24, stages=[Stage(3, 16, 4)])
    one = LongCtxDataModule(staged, rank=0, world_size=1)
    take(one, 2)
    accumulating = LongCtxDataModule(staged, rank=0, world_size=1, accumulate_grad_batches=2)
    with pytest.raises(
        ValueError, match=r"with 2 micro-batches per optimizer step.*written with 1"
    ):
        accumulating.load_state_dict(one.state_dict())
    other = LongCtxDataModule(DataConfig(**config, chunk_documents=24, seed=1), rank=0)
    with pytest.raises(ValueError, match=r"data.seed: 0 -> 1"):
        other.load_state_dict(
            LongCtxDataModule(DataConfig(**config, chunk_documents=24)).state_dict()
        )


def test_stages_that_outlast_max_steps_warn(tmp_path, capsys):
    stages = [Stage(2, 64, 2), Stage(8, 128, 2)]
    assert unreached_stages(stages, 10) == []
    (warning,) = unreached_stages(stages, 8)
    assert "data.stages[1].until_step=8 is not below trainer.max_steps=8" in warning
    late = "data.stages=[{until_step:9,seq_len:128,micro_batch_size:2}]"
    run(compose([*FAST, late, "trainer.max_steps=5", "dry_run=true"], output_dir=tmp_path))
    assert "data.stages[0].until_step=9 is not below trainer.max_steps=5" in capsys.readouterr().out


# ------------------------------------------------------------------ the CPU capacity plan
def test_the_cpu_plan_adds_the_retained_heap_of_train_py(tmp_path):
    """train.py keeps freed heap blocks on CPU, and its peak RSS exceeds the tensors alive at
    once by about CPU_HEAP_RETENTION x their peak (benchmarks/bench_train_rss.py): the CPU plan
    holds that allowance, a GPU plan does not."""
    import dataclasses

    from longctx.planner.memory import peak_bytes, step_tensor_terms
    from longctx.train.dry_run import planner_device

    config, layout = LlamaConfig.from_name("tiny"), planner.RunLayout(seq_len=16384)
    exact = planner.Device("cpu", 24 * 10**9, None, 400 * 2**20, "measured")
    retaining = dataclasses.replace(exact, heap_retention=0.3)
    tensors = peak_bytes(step_tensor_terms(config, layout))
    without, with_heap = (
        planner.plan(config, layout, exact),
        planner.plan(config, layout, retaining),
    )
    assert with_heap.total_bytes - without.total_bytes == int(0.3 * tensors)
    assert "retained heap (glibc, freed blocks kept)" in {t.name for t in with_heap.terms}
    assert "retained heap (glibc, freed blocks kept)" not in {t.name for t in without.terms}
    with pytest.raises(planner.PlanError, match="heap_retention=nan"):
        dataclasses.replace(exact, heap_retention=float("nan"))

    cfg = compose(FAST, output_dir=tmp_path)
    cpu = planner_device(cfg, check_planner(cfg), torch.device("cpu"))
    assert cpu.heap_retention == planner.CPU_HEAP_RETENTION > 0
    cfg = compose([*FAST, "planner.device=H100"])
    gpu = planner_device(cfg, check_planner(cfg), torch.device("cuda"))
    assert gpu.heap_retention == 0


# ------------------------------------------------------------------ the step axis
class RecordingLogger(Logger):
    """What a logger (W&B's, the CSV one) is handed: (step, metric names) of every call."""

    name, version = "recording", "0"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, set[str]]] = []
        self.unsaved = self.most_unsaved = 0  # rows not yet saved: a crash would lose them

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, set(metrics)))
        self.unsaved += 1
        self.most_unsaved = max(self.most_unsaved, self.unsaved)

    def save(self) -> None:
        self.unsaved = 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def test_loggers_get_one_row_per_optimizer_step_under_accumulation():
    import lightning as L
    from module_fixtures import random_batch, small_module

    logger = RecordingLogger()
    batches = [random_batch(i, [[32, 32]], 64) for i in range(6)]  # 3 steps of 2 micro-batches
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer.fit(small_module(accumulate=2), train_dataloaders=loader)
    assert [step for step, names in logger.calls if "train/loss" in names] == [1, 2, 3]
    assert not [names for _, names in logger.calls if {"epoch", "step"} & names]
    assert logger.most_unsaved == 1  # each row saved before the next step's
