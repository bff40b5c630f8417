"""python -m longctx.eval CHECKPOINT [--seq-len L] [--out DIR] [--suite ruler] [--hf DIR] ..."""

from longctx.eval.cli import command_line

if __name__ == "__main__":
    command_line()
