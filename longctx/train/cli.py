"""The training command line: ``python train.py`` (or ``longctx-train``) and ``longctx-plan``.

Both compose the checkout's conf/ (an editable install: the configs are the repository's, not
package data) with the command line's overrides and hand the result to longctx.train.app.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra

from longctx.cli import exit_on_user_error
from longctx.train.app import main
from longctx.train.preflight import ConfigError, check_moved_overrides
from longctx.train.resolvers import register_with_hydra

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def train_cli() -> None:
    try:
        check_moved_overrides(sys.argv[1:])
    except ConfigError as err:
        exit_on_user_error(err)
    register_with_hydra()
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")(main)()


def plan_cli() -> None:
    """The capacity plan of a configuration (dry_run=true): nothing is allocated or trained."""
    sys.argv.append("dry_run=true")
    train_cli()
