"""Serve a longctx export with vLLM and compare its greedy tokens with transformers'.

    python scripts/vllm_export_check.py OUT_DIR      # exit 0 and "skipped" when vLLM is absent

Run by scripts/gpu_check.sh. Builds a small random Llama (YaRN x4 from 64, trained length 256)
with the run record train.py stores, exports it with longctx.hf.export, then checks what vLLM
derives from config.json (max_model_len), and that vLLM's greedy continuation of a prompt equals
transformers' on the same export. Needs no Hydra: the record is written as plain data.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=320)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position": 64}


def make_checkpoint(folder: Path) -> Path:
    from longctx.model import Llama, LlamaConfig
    from longctx.runs.record import CHECKPOINT_KEY

    fields = {"name": "tiny", **SHAPES, "attn_backend": "sdpa", "rope_scaling": YARN}
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name(**fields))
    record = {
        "model": {"_target_": "longctx.model.LlamaConfig.from_name", **fields},
        "data": {"_target_": "longctx.data.DataConfig", "seq_len": 256},
    }
    ckpt = folder / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, CHECKPOINT_KEY: {"identity": {}, "config": record}}, ckpt)
    return ckpt


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "vllm_check")
    if importlib.util.find_spec("vllm") is None:
        print("vllm: not importable here, skipped")
        return 0
    import transformers
    import vllm

    from longctx.hf.export import export

    out.mkdir(parents=True, exist_ok=True)
    folder = export(make_checkpoint(out), out / "hf").folder
    prompt = "In the beginning"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=False
    )
    ids = tokenizer(prompt, return_tensors="pt")
    theirs = model.generate(**ids, max_new_tokens=16, do_sample=False)[0, ids.input_ids.shape[1] :]
    llm = vllm.LLM(model=str(folder), dtype="float32", enforce_eager=True)
    max_model_len = llm.llm_engine.model_config.max_model_len
    params = vllm.SamplingParams(max_tokens=16, temperature=0.0)
    served = llm.generate([prompt], params)[0].outputs[0].token_ids
    result = {
        "vllm": vllm.__version__,
        "max_position_embeddings": json.loads((folder / "config.json").read_text())[
            "max_position_embeddings"
        ],
        "vllm_max_model_len": max_model_len,
        "greedy_equal": list(served) == theirs.tolist(),
        "transformers_tokens": theirs.tolist(),
        "vllm_tokens": list(served),
    }
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    ok = result["greedy_equal"] and max_model_len == result["max_position_embeddings"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
