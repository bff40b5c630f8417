"""The LightningModule: token-mean loss over a whole optimizer step, AdamW, warm-up + cosine.

Optimisation is manual so the loss is normalised by the target tokens of the *whole* step:
every micro-batch backpropagates its loss *sum*, and at the step boundary the gradients are
divided by the number of target tokens summed over accumulation steps and ranks. A per-micro-batch
mean (what automatic optimisation with ``accumulate_grad_batches`` gives) weights tokens unequally
when micro-batches hold different numbers of targets: the known silent bug this avoids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard, context_shard, gather_row
from longctx.cp_balance import DEFAULT_BALANCE, PlanStats, context_parallel_metrics
from longctx.data.dp_balance import RowCost, imbalance
from longctx.data.streams import StreamBatch
from longctx.distributed.context_parallel import all_gather_over, context_parallel_group
from longctx.distributed.elastic import GlobalBatch, resume_accumulation
from longctx.errors import LongctxError
from longctx.eval.position_loss import PositionLoss
from longctx.model.interface import ModelSpec, PackedCausalLM
from longctx.train.nonfinite import NonFiniteGuard
from longctx.train.optim_config import OptimConfig
from longctx.train.step_axis import STEP_KEY, log_at_step, validate_at_optimizer_steps


def load_init_weights(model: nn.Module, device: torch.device | str) -> None:
    """``model.init_from``, a new stage: a model built on the meta device (maybe FSDP2-sharded)
    materialised on ``device`` and filled from ``model.config.init_from`` (what a source may be,
    and how it is checked and read: longctx.hf.weight_source, imported here as it loads
    transformers)."""
    from longctx.hf.weight_source import check_finite_weights, resolve

    model.to_empty(device=device)
    resolve(model.config.init_from).load_into(model)
    check_finite_weights(model, f"model.init_from={model.config.init_from!r}")


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 to the peak lr, then cosine decay to min_lr_ratio * peak (the
    settings: conf/optim/, their one source)."""
    if total_steps < 1 or warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:  # NaN: refused
        raise LongctxError(
            f"schedule needs total_steps >= 1, warmup_steps >= 0, 0 <= min_lr_ratio <= 1; got "
            f"total_steps={total_steps}, warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}"
        )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    configured: list[dict],
) -> None:
    """Give a resumed optimizer the configured hyperparameters. Loading a checkpoint restores its
    param groups' values (lr, betas, eps, weight_decay, ...) and the schedule's base lrs, so
    without this a changed value would be recorded but not used. ``configured``: the param
    groups a fresh optimizer gets from the config. The current lr becomes the configured base lr
    at the schedule's resumed step (the schedule's own settings come from the config already)."""
    for i, (group, new) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        old_base = group.get("initial_lr", group["lr"])
        group.update({k: v for k, v in new.items() if k not in ("params", "lr", "initial_lr")})
        group["initial_lr"] = new["lr"]
        if scheduler is None:
            group["lr"] = new["lr"]
        elif isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            group["lr"] = new["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        elif old_base:  # another schedule: scaled by the change of its base
            group["lr"] *= new["lr"] / old_base
    if scheduler is not None:
        scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms (1-D) and embeddings are excluded from weight decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in embeddings else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class LongCtxModule(L.LightningModule):
    def __init__(
        self,
        model_config: ModelSpec,
        optim: OptimConfig,
        *,
        compile: bool = False,
        peak_flops_per_device: float | None = None,
        eos_id: int | None = None,
        context_parallel: int = 1,
        context_parallel_rounds: int = 1,
        context_parallel_balance: str = DEFAULT_BALANCE,
        row_cost: RowCost | None = None,
    ) -> None:
        """``optim``: the optimizer, schedule and step settings (conf/optim/, checked by
        OptimConfig); ``row_cost``: the planner's cost of a row, which weighs each rank's rows
        for train/dp_work_imbalance (longctx.planner.dp_balance.training_row_cost)."""
        super().__init__()
        if context_parallel != 1 and not model_config.supports_context_parallel:
            raise LongctxError(
                f"context_parallel={context_parallel}: {type(model_config).__name__}'s model "
                "cannot take a row split over ranks (only longctx's Llama can)"
            )
        self.automatic_optimization = False
        self.model_config = model_config
        self.model = model_config.build()  # see ModelSpec.build
        if not isinstance(self.model, PackedCausalLM):
            raise TypeError(
                f"the model spec {model_config!r:.200} built a {type(self.model).__name__}; "
                "expected a longctx.model.interface.PackedCausalLM (hidden_states, output_weight, "
                "estimate_flops)"
            )
        self.optim = optim
        # a resume may choose another to keep the global batch (_keep_resumed_global_batch)
        self.accumulate_grad_batches = optim.accumulate_grad_batches
        self.compile, self.peak_flops_per_device = compile, peak_flops_per_device
        self.eos_id = eos_id
        self.context_parallel = context_parallel
        self.context_parallel_rounds = context_parallel_rounds
        self.context_parallel_balance = context_parallel_balance
        self.row_cost = row_cost
        self.cp_group = None  # set in setup() once the process group exists
        self.nonfinite = NonFiniteGuard(optim.skip_nonfinite)
        self.tokens_seen = 0
        self._micro_batch_rows: int | None = None  # seen in training; part of the global batch
        self._resumed_global_batch: GlobalBatch | None = None  # to keep, from a checkpoint
        # set by a checkpoint load: its optimizer settings are replaced in on_train_start
        self._resumed = False
        self._reset_accumulators()
        self.val_position_loss: PositionLoss | None = None

    def setup(self, stage: str) -> None:
        if self.context_parallel > 1 and self.cp_group is None:
            self.cp_group = context_parallel_group(self.context_parallel)

    def on_fit_start(self) -> None:
        validate_at_optimizer_steps(self.trainer, lambda: self.at_step_boundary)

    def on_train_start(self) -> None:
        """After a resume (Lightning has loaded the optimizer and schedule state by now): train
        with the configured optimizer settings, not the checkpoint's (a change was allowed by
        name before the run began: longctx.runs.resume)."""
        if not self._resumed:
            return
        self._resumed = False
        configured = self.optim.optimizer(param_groups(self.model, self.optim.weight_decay))
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        apply_hyperparameters(optimizer, self.lr_schedulers(), configured.param_groups)

    def rank_shard(self, batch: PackedBatch) -> PackedBatch:
        """This rank's share of the rows under context parallelism; the batch itself without."""
        if self.context_parallel == 1:
            return batch
        rank = torch.distributed.get_rank(self.cp_group)
        return context_shard(
            batch,
            rank,
            self.context_parallel,
            all_gather_over(self.cp_group),
            balance=self.context_parallel_balance,
            rounds=self.context_parallel_rounds,
        )

    def configure_model(self) -> None:
        if self.compile:
            # per block, in place: the model keeps its methods (loss, token_loss) and its
            # state-dict keys, and one compiled graph serves every layer
            for block in self.model.layers:
                block.compile()
        if self._device_mesh is not None and not self._is_sharded():
            # ModelParallelStrategy: FSDP2, fully_shard per block then the root. Settings come
            # from longctx.distributed.fsdp.FSDP2Strategy; a plain ModelParallelStrategy gets defaults.
            from longctx.distributed.fsdp import apply_fsdp

            shard = getattr(self.trainer.strategy, "shard", None)
            shard(self.model) if shard else apply_fsdp(self.model, self._device_mesh)
        if any(p.is_meta for p in self.model.parameters()):  # model.init_from, not yet read
            load_init_weights(self.model, self.trainer.strategy.root_device)

    def _is_sharded(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.model, FSDPModule)

    def configure_optimizers(self):
        optimizer = self.optim.optimizer(param_groups(self.model, self.optim.weight_decay))
        if self.optim.scheduler is None:
            return optimizer
        total = self.trainer.max_steps
        if total is None or total < 1:
            raise LongctxError(
                f"trainer.max_steps must be set (>= 1) for the lr schedule, got {total}"
            )
        scheduler = self.optim.scheduler(optimizer, total)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        global_batch = self._global_batch()
        checkpoint["longctx"] = {
            "tokens_seen": self.tokens_seen,
            "global_batch": None if global_batch is None else dataclasses.asdict(global_batch),
            "nonfinite_skipped": self.nonfinite.skipped,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("longctx", {})
        self.tokens_seen = state.get("tokens_seen", 0)
        self.nonfinite.skipped = state.get("nonfinite_skipped", 0)
        self._resumed = True
        if "global_batch" not in state:
            raise LongctxError(
                "the checkpoint has no longctx.global_batch (rows per optimizer step; written "
                "since elastic resume), so the step it resumes cannot be kept: it was written "
                "by an earlier longctx, whose data order this one cannot continue either"
            )
        saved = state["global_batch"]  # None: saved before the first step, nothing to keep
        self._resumed_global_batch = GlobalBatch(**saved) if saved else None

    @property
    def at_step_boundary(self) -> bool:
        """No micro-batch of an optimizer step is pending: a checkpoint now loses nothing."""
        return self._micro == 0

    @property
    def data_parallel_size(self) -> int:
        return self.trainer.world_size // self.context_parallel

    def _global_batch(self) -> GlobalBatch | None:
        """This run's global batch, once a micro-batch has shown its rows (else the resumed one)."""
        if self._micro_batch_rows is None:
            return self._resumed_global_batch
        return GlobalBatch(
            self._micro_batch_rows, self.accumulate_grad_batches, self.data_parallel_size
        )

    def _keep_resumed_global_batch(self, micro_batch_rows: int) -> None:
        """After a resume, the accumulation that keeps the checkpoint's global batch here."""
        self.accumulate_grad_batches, note = resume_accumulation(
            self._resumed_global_batch,
            micro_batch_rows,
            self.data_parallel_size,
            configured=self.accumulate_grad_batches,
            allow_change=self.optim.allow_global_batch_change,
        )
        self._resumed_global_batch = None
        if note:
            rank_zero_info(note)

    def training_step(self, batch: PackedBatch, batch_idx: int) -> None:
        if self._resumed_global_batch is not None:
            if batch.shape[0] == self._resumed_global_batch.micro_batch_rows:
                self._keep_resumed_global_batch(batch.shape[0])
            else:  # the data state refuses another micro_batch_size: a new stage began
                self._resumed_global_batch = None
        self._micro_batch_rows = batch.shape[0]
        if self._micro == 0:
            self._step_start = time.perf_counter()
        last_micro = self._micro + 1 == self.accumulate_grad_batches
        with self._maybe_no_sync(not last_micro):
            shard = self.rank_shard(batch)
            loss_sum, num_tokens = self.model.loss(shard)
            self.manual_backward(loss_sum)
        self._accumulate(batch, loss_sum.detach(), num_tokens)
        if isinstance(shard, ContextShard):
            self._cp_plans.append(shard.plan)
        if last_micro:
            self._optimizer_step()

    def _accumulate(self, batch: PackedBatch, loss_sum: Tensor, num_tokens: int) -> None:
        """Sums over ranks at the step boundary: the context-parallel ranks of a row each count
        their share (loss and targets of their tokens, 1/N of tokens and FLOPs), so the logged
        numbers are the rows' own, counted once."""
        self._micro += 1
        stream = isinstance(batch, StreamBatch)  # the train stream's: knows stage and packing
        origin = batch.origin if stream else None
        self._stage, self._seq_len = (origin.stage if origin else 0), batch.shape[1]
        self._loss_sum += loss_sum.float()
        self._num_targets += num_tokens
        self._num_input_tokens += batch.tokens.numel() // self.context_parallel
        if self.peak_flops_per_device:
            self._flops += self.model.estimate_flops(batch.seq_lens) / self.context_parallel
        # (non-pad token fraction, documents per row) as the packer counted them; unknown (NaN)
        # for a batch that does not come from the train stream
        packing = (batch.packing_efficiency, batch.docs_per_row) if stream else (math.nan,) * 2
        self._batch_stats.append(packing)
        if self.row_cost is not None:
            self._rank_cost += float(self.row_cost.costs(batch.seq_lens.cpu().numpy()).sum())

    def _optimizer_step(self) -> None:
        opt, sched = self.optimizers(), self.lr_schedulers()
        totals = self._reduce_sum([self._loss_sum, self._num_targets, self._num_input_tokens])
        loss_sum, num_targets, num_tokens = totals[0], int(totals[1]), int(totals[2])
        # DDP/FSDP average gradients over ranks: times world size, over the step's targets.
        self._scale_gradients(self.trainer.world_size / max(num_targets, 1))
        grad_norm = self._clip_gradients()
        loss = loss_sum / max(num_targets, 1)
        # every rank sees the same reduced loss and norm, so all skip or stop together
        skipped = self.nonfinite.check(self.global_step + 1, float(loss), float(grad_norm))
        if skipped is not None:
            rank_zero_info(skipped)
            opt.zero_grad(set_to_none=True)
            self._reset_accumulators()
            return
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        self.tokens_seen += num_tokens
        self._log_step(loss, grad_norm, num_tokens, opt)
        self._reset_accumulators()

    def _scale_gradients(self, factor: float) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def _clip_gradients(self) -> Tensor:
        max_norm = self.optim.grad_clip if self.optim.grad_clip else float("inf")
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm).detach()
        # FSDP2: the grads are sharded DTensors and so is the norm (reduced over ranks)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _reduce_sum(self, values: list) -> Tensor:
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])
        stacked = stacked.to(self.device)
        if self.trainer.world_size > 1:
            stacked = self.trainer.strategy.reduce(stacked, reduce_op="sum")
        return stacked.cpu()

    def _maybe_no_sync(self, skip_sync: bool):
        strategy = self.trainer.strategy
        if self._device_mesh is not None and self._is_sharded():
            # FSDP2: no reduce-scatter until the last micro-batch of the step
            self.model.set_requires_gradient_sync(not skip_sync)
            return contextlib.nullcontext()
        if skip_sync and hasattr(strategy, "block_backward_sync"):
            return strategy.block_backward_sync()
        return contextlib.nullcontext()

    def _log_step(self, loss: Tensor, grad_norm: Tensor, num_tokens: int, opt) -> None:
        elapsed = time.perf_counter() - self._step_start
        efficiency = sum(s[0] for s in self._batch_stats) / len(self._batch_stats)
        docs_per_row = sum(s[1] for s in self._batch_stats) / len(self._batch_stats)
        metrics = {
            "train/loss": float(loss),
            "train/lr": opt.param_groups[0]["lr"],
            "train/grad_norm": float(grad_norm),
            "train/tokens_per_s": num_tokens / elapsed,
            "train/tokens_seen": float(self.tokens_seen),
            "train/stage": float(self._stage),
            "train/seq_len": float(self._seq_len),
        }
        if not math.isnan(efficiency):
            metrics["train/packing_efficiency"] = efficiency
            metrics["train/docs_per_row"] = docs_per_row
        metrics.update(context_parallel_metrics(self._cp_plans))
        metrics.update(self._data_parallel_metrics())
        if self.peak_flops_per_device:
            metrics["train/mfu"] = self._flops / elapsed / self.peak_flops_per_device
        if self.nonfinite.skipped:
            metrics["train/nonfinite_skipped"] = float(self.nonfinite.skipped)
        # the loggers get one row per optimizer step (longctx.train.step_axis); Lightning keeps
        # the values for callbacks and the progress bar only
        log_at_step(self.trainer, metrics, self.global_step)
        self.log_dict(metrics, prog_bar=False, logger=False, batch_size=1, rank_zero_only=True)
        self.log("loss", float(loss), prog_bar=True, logger=False, batch_size=1)

    def _reset_accumulators(self) -> None:
        self._micro = 0
        self._loss_sum = torch.zeros((), dtype=torch.float64)
        self._num_targets = 0
        self._num_input_tokens = 0
        self._flops = 0.0
        self._batch_stats: list[tuple[float, float]] = []
        self._cp_plans: list[PlanStats] = []
        self._rank_cost = 0.0  # predicted cost of this rank's rows in the step (row_cost)
        self._step_start = time.perf_counter()

    def _data_parallel_metrics(self) -> dict[str, float]:
        """``train/dp_work_imbalance``: max / mean over the ranks of the predicted cost of their
        rows in the step (the planner's row cost; data.dp_balance lowers it). Context-parallel
        ranks share rows, so they count equal copies: the max and mean of the data-parallel
        ranks'. Empty without a row cost."""
        if self.row_cost is None:
            return {}
        costs = torch.tensor([self._rank_cost], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            costs = self.all_gather(costs)
        return {"train/dp_work_imbalance": imbalance(costs.reshape(-1).cpu().numpy())}

    def on_validation_epoch_start(self) -> None:
        seq_len = self.trainer.datamodule.config.seq_len if self.trainer.datamodule else None
        self.val_position_loss = PositionLoss(seq_len or 1, eos_id=self.eos_id)

    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        shard = self.rank_shard(batch)
        token_loss = self.model.token_loss(shard).detach()
        if shard is not batch:  # the rows' losses from the group; its first rank counts them
            token_loss = gather_row(token_loss, shard)
            if torch.distributed.get_rank(self.cp_group) != 0:
                return
        self.val_position_loss.update(token_loss, batch)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_position_loss
        acc.all_reduce(self.trainer.strategy)
        loss = acc.mean_loss()
        metrics = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
        metrics.update(acc.bucket_metrics("val"))
        self.log_dict(metrics, batch_size=1, sync_dist=False)
        # the x-axis of this row (and of the callbacks' validation metrics logged with it)
        self.log(STEP_KEY, float(self.global_step), batch_size=1, prog_bar=False)

    def on_validation_end(self) -> None:
        # Lightning keeps the logged step among the callback metrics, and ModelCheckpoint names
        # its files from that ``step`` when present: left there, the save at step 8 would be
        # named (and overwrite) the step-4 file of the last validation. Callbacks ran already.
        self.trainer.callback_metrics.pop(STEP_KEY, None)
