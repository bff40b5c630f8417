"""python -m longctx.eval CHECKPOINT [--seq-len L] [--out DIR] [--backend NAME] ..."""

from longctx.eval.cli import cli

if __name__ == "__main__":
    cli()
