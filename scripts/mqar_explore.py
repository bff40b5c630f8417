"""The MQAR control's calibration scratch loop (docs/recall.md, calibration): longctx's Llama on
packed MQAR rows with a plain AdamW loop, one thread, accuracy on held-out rows every --every
steps. The study itself trains through train.py (experiment=recall); this loop found the regime.

    python scripts/mqar_explore.py --lr 3e-3 --steps 3000 --out run.json
"""

import argparse
import json
import math
import time

import numpy as np
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.model.config import LlamaConfig
from longctx.synthetic.mqar import MqarVocab, mqar_document

p = argparse.ArgumentParser()
p.add_argument("--dim", type=int, default=128)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--ffn", type=int, default=256)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--wd", type=float, default=0.1)
p.add_argument("--warmup", type=int, default=100)
p.add_argument("--steps", type=int, default=2000)
p.add_argument(
    "--stop",
    type=int,
    default=None,
    help="stop early at this step (the schedule still spans --steps)",
)
p.add_argument(
    "--curriculum",
    type=int,
    default=0,
    help="steps over which the most pairs grow from 4 to --dmax",
)
p.add_argument(
    "--stage1",
    type=int,
    default=0,
    help="first train this many steps on documents of at most 4 pairs (own warmup and cosine),"
    " then a fresh optimizer and schedule over --steps on the full mix: train.py's two stages",
)
p.add_argument("--row", type=int, default=512)
p.add_argument("--rows", type=int, default=8)
p.add_argument("--dmin", type=int, default=2)
p.add_argument("--dmax", type=int, default=32)
p.add_argument("--slot-ratio", type=float, default=1.5)
p.add_argument("--keys", type=int, default=512)
p.add_argument("--all-tokens", action="store_true")
p.add_argument("--no-mask", action="store_true")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--every", type=int, default=200)
p.add_argument("--theta", type=float, default=10000.0)
p.add_argument("--out", default=None)
a = p.parse_args()
for name in ("stop", "curriculum", "stage1"):
    value = getattr(a, name)
    if value is not None and (value < 0 or (name == "stop" and value == 0)):
        p.error(f"--{name.replace('_', '-')}={value}; expected a positive step count")
if a.stage1 >= (a.stop or a.steps):
    p.error(f"--stage1={a.stage1}; expected fewer steps than the run's ({a.stop or a.steps})")
torch.set_num_threads(1)
torch.manual_seed(a.seed)
vocab = MqarVocab(a.keys, a.keys)


current_step = 10**9  # held-out rows (drawn before training) use the full mix


def most_pairs():
    # the curriculum: few pairs first (the plateau breaks fast there), geometric growth to --dmax
    if a.stage1:
        return 4 if current_step <= a.stage1 else a.dmax
    if not a.curriculum or current_step >= a.curriculum:
        return a.dmax
    return round(4 * (a.dmax / 4) ** (current_step / a.curriculum))


def draw_pairs(rng):
    # log-uniform: long-tailed lengths, many short documents
    return int(round(math.exp(rng.uniform(math.log(a.dmin), math.log(most_pairs())))))


def doc(rng):
    d = draw_pairs(rng)
    return mqar_document(rng, vocab, d, max(d, math.ceil(a.slot_ratio * d)))


def packed(rng, rows):
    toks, labs, lens = [], [], []
    for _ in range(rows):
        t, lab, ln, n = [], [], [], 0
        while True:
            dd = doc(rng)
            if n + len(dd.tokens) > a.row:
                break
            lab_d = np.full(len(dd.tokens), IGNORE_INDEX)
            if a.all_tokens:
                lab_d[:-1] = dd.tokens[1:]
            lab_d[dd.query_positions] = dd.answers
            t.append(dd.tokens), lab.append(lab_d), ln.append(len(dd.tokens))
            n += len(dd.tokens)
        pad = a.row - n
        t.append(np.zeros(pad, np.int64)), lab.append(np.full(pad, IGNORE_INDEX)), ln.append(pad)
        toks.append(np.concatenate(t)), labs.append(np.concatenate(lab))
        lens.append([x for x in ln if x] + [0] * 0)
    width = max(len(x) for x in lens)
    lens = [x + [0] * (width - len(x)) for x in lens]
    seq = lens if not a.no_mask else [[a.row]] * rows
    return PackedBatch.from_lengths(
        torch.tensor(np.stack(toks)),
        seq,
        reset_position_ids=True,
        labels=torch.tensor(np.stack(labs)),
    )


cfg = LlamaConfig(
    vocab_size=vocab.size,
    dim=a.dim,
    n_layers=a.layers,
    n_heads=a.heads,
    n_kv_heads=a.heads,
    ffn_dim=a.ffn,
    max_seq_len=8192,
    rope_theta=a.theta,
    attn_backend="sdpa",
    loss_chunk_size=8192,
)
model = cfg.build()


def optimizer(steps):
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1, (s + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * min(1, s / steps))),
    )
    return opt, sched


opt, sched = optimizer(a.stage1 or a.steps)
eval_batches = [packed(np.random.default_rng(10_000 + i), a.rows) for i in range(4)]


@torch.no_grad()
def accuracy():
    model.eval()
    hit = tot = 0
    for b in eval_batches:
        logits = model.labelled_logits(b)
        want = b.labels[b.labels != IGNORE_INDEX]
        sel = want >= vocab.first_value
        hit += (logits.argmax(-1)[sel] == want[sel]).sum().item()
        tot += sel.sum().item()
    model.train()
    return hit / tot


rng = np.random.default_rng(a.seed)
t0, tokens, log = time.time(), 0, []
for step in range(1, (a.stop or a.steps) + 1):
    current_step = step
    if a.stage1 and step == a.stage1 + 1:
        opt, sched = optimizer(a.steps - a.stage1)
    b = packed(rng, a.rows)
    loss_sum, n = model.loss(b)
    (loss_sum / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(), opt.zero_grad(), sched.step()
    tokens += b.tokens.numel()
    if step % a.every == 0 or step == (a.stop or a.steps):
        acc = accuracy()
        row = dict(
            step=step,
            tokens=tokens,
            loss=round(loss_sum.item() / n, 4),
            acc=round(acc, 4),
            wall=round(time.time() - t0, 1),
        )
        log.append(row)
        print(json.dumps(row), flush=True)
if a.out:
    with open(a.out, "w") as f:
        json.dump(dict(args=vars(a), log=log), f)
