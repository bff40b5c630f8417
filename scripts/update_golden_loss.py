"""Regenerate tests/assets/golden_tiny_loss.json: the tiny model's first 20 training losses.

Run only when a change is *meant* to alter numerics, and say so in the commit:
    .venv/bin/python scripts/update_golden_loss.py
"""

import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import FAST  # noqa: E402

OVERRIDES = [*FAST, "trainer.max_steps=20", "trainer.deterministic=true", "seed=0"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), f"paths.root_dir={tmp}", *OVERRIDES]
        subprocess.run([*cmd, "run_name=golden"], check=True, cwd=tmp)
        with open(Path(tmp) / "outputs" / "train" / "golden" / "csv" / "metrics.csv") as f:
            losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    out = ROOT / "tests" / "assets" / "golden_tiny_loss.json"
    # paths.cache_dir differs per checkout and does not affect numerics: not stored
    stored = [o for o in OVERRIDES if not o.startswith("paths.cache_dir=")]
    out.write_text(json.dumps({"overrides": stored, "losses": losses}, indent=1) + "\n")
    print(f"wrote {len(losses)} losses to {out}")


if __name__ == "__main__":
    main()
