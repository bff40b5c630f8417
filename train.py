"""Train a long-context model: python train.py [group=option ...] [key=value ...]

Examples:
    python train.py                                     # tiny model, embedded corpus, CPU
    python train.py model=llama3_8b data.reset_position_ids=false trainer=gpu
    python train.py -m experiment=position_ablation     # the 2x2 ablation grid
    python train.py ckpt_path=last                      # resume the most recent run
"""

from longctx.train.cli import train_cli

if __name__ == "__main__":
    train_cli()
