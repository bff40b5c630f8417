"""Train a long-context model: python train.py [group=option ...] [key=value ...]

Examples:
    python train.py                                     # tiny model, embedded corpus, CPU
    python train.py model=llama3_8b data.reset_position_ids=false trainer=gpu
    python train.py -m experiment=position_ablation     # the 2x2 ablation grid
    python train.py ckpt_path=last                      # resume the most recent run
"""

import sys

import hydra
from omegaconf import DictConfig

from longctx.cli import exit_on_user_error
from longctx.train.app import main
from longctx.train.preflight import ConfigError, check_moved_overrides
from longctx.train.resolvers import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def train(cfg: DictConfig) -> float | None:
    return main(cfg)


if __name__ == "__main__":
    try:
        check_moved_overrides(sys.argv[1:])
    except ConfigError as err:
        exit_on_user_error(err)
    train()
