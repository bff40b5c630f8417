"""python -m longctx.probe: see longctx.probe.cli."""

from longctx.probe.cli import run

if __name__ == "__main__":
    run()
