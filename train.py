"""Train a long-context model: python train.py [group=option ...] [key=value ...]

Examples:
    python train.py                                     # tiny model, embedded corpus, CPU
    python train.py model=llama3_8b data.reset_position_ids=false trainer=gpu
    python train.py -m experiment=position_ablation     # the 2x2 ablation grid
    python train.py ckpt_path=last                      # resume the most recent run
"""

import hydra
from omegaconf import DictConfig

from longctx.train.app import main, register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def train(cfg: DictConfig) -> float | None:
    return main(cfg)


if __name__ == "__main__":
    train()
