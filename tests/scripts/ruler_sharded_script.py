"""Run by tests/e2e/test_ruler_sharded.py: the in-loop suite's scoring (RulerEval.score) on
2 gloo ranks, as data-parallel replicas (DP=2; also with the model sharded by FSDP2) and as one
context-parallel group (CP=2), in both scoring modes. Rank 0 prints one JSON line per case: {"case": ..., "rows": [...]}, and the rows
of the same instances scored by one process without any distribution ("single").

    python ruler_sharded_script.py OUT.jsonl
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from longctx.data import ByteTokenizer
from longctx.distributed.context_parallel import context_parallel_group
from longctx.distributed.fsdp import apply_fsdp
from longctx.eval.ruler.callback import RulerEval
from longctx.eval.ruler.instances import Instance
from longctx.eval.ruler.scoring import score_instances
from longctx.model import LlamaConfig
from longctx.train.module import LongCtxModule
from longctx.train.optim_config import OptimConfig

TOK = ByteTokenizer()
WORLD = 2
MODES = ("teacher_forced", "generate")
# (length, tokens_to_generate, answer): odd row lengths (the CP split pads them), two batch
# shapes, seven instances (the DP shares are padded)
SPECS = [(61, 6, "4821"), (61, 6, "7305"), (80, 9, "apple, pear"), (61, 6, "1190"),
         (80, 9, "plum"), (61, 6, "6654"), (80, 9, "fig and kiwi")]  # fmt: skip


def instances() -> list[Instance]:
    out = []
    for i, (length, gen, answer) in enumerate(SPECS):
        prompt = np.random.default_rng(i).integers(97, 123, length - gen)
        answer_ids = TOK.encode(" " + answer)
        out.append(
            Instance(
                task=f"t{length}", length=length, depth=0.5, sample=i, seed=0,
                tokens=np.concatenate([prompt, answer_ids]).astype(np.int64), answer=answer,
                answer_len=len(answer_ids), references=tuple(answer.split(", ")),
                tokens_to_generate=gen,
            )
        )  # fmt: skip
    return out


def module(context_parallel: int) -> LongCtxModule:
    torch.manual_seed(0)  # the same weights on every rank and in every case
    config = LlamaConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=259,
        attn_backend="sdpa", init_std=0.15,
    )  # fmt: skip
    pl = LongCtxModule(
        config, OptimConfig(partial(torch.optim.SGD, lr=0.1)), context_parallel=context_parallel
    )
    if context_parallel > 1:
        pl.cp_group = context_parallel_group(context_parallel)
    return pl


def scored(pl: LongCtxModule, mode: str, rank: int, batch_size: int = 2) -> list[dict]:
    callback = RulerEval(batch_size=batch_size, scoring=mode)
    callback.instances, callback.tokenizer = instances(), TOK
    trainer = SimpleNamespace(
        global_rank=rank,
        world_size=WORLD,
        precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext),
    )
    return callback.score(trainer, pl)


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        lines = []
        for mode in MODES:
            for case, cp in (("dp2", 1), ("cp2", 2), ("fsdp2", 1)):
                pl = module(cp)
                if case == "fsdp2":  # the replicas' model sharded: every forward all-gathers
                    apply_fsdp(pl.model, init_device_mesh("cpu", (WORLD,)))
                rows = scored(pl, mode, rank)
                lines.append({"case": f"{case} {mode}", "rank": rank, "rows": rows})
            if rank == 0:
                single = score_instances(
                    module(1).model.eval(), instances(), 3, scoring=mode, tokenizer=TOK
                )
                lines.append({"case": f"single {mode}", "rank": 0, "rows": single})
        with open(f"{out}.{rank}", "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    port = 29000 + os.getpid() % 2000
    mp.spawn(worker, args=(sys.argv[1], port), nprocs=WORLD)
