"""Opens longctx exports with the transformers of the Python running it (the 4.x venv of
tests/test_export_tf4.py) and checks them against what longctx computed: token ids, logits,
generate, pipeline, and the config's own validation. Imports nothing of longctx.

    python export_tf4_check.py CASES.json   # prints one JSON line; exit 1 on any failure
"""

import json
import logging
import sys

import torch
import transformers


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def check(case: dict) -> list[str]:
    folder, problems = case["folder"], []
    caught = Warnings()
    logging.getLogger("transformers").addHandler(caught)
    config = transformers.AutoConfig.from_pretrained(folder)  # runs its rope validation
    logging.getLogger("transformers").removeHandler(caught)
    problems += [f"config warning: {m}" for m in caught.messages]
    if config.max_position_embeddings != case["max_position_embeddings"]:
        problems.append(f"max_position_embeddings {config.max_position_embeddings}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.model_max_length != case["max_position_embeddings"]:
        problems.append(f"model_max_length {tokenizer.model_max_length}")
    for text, ids in zip(case["texts"], case["ids"], strict=True):
        encoded = tokenizer(text)
        if encoded["input_ids"] != ids or tokenizer.encode(text) != ids:
            problems.append(f"ids of {text!r}: {encoded['input_ids']} != {ids}")
        if set(encoded) != {"input_ids", "attention_mask"}:
            problems.append(f"keys {sorted(encoded)}")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = torch.load(case["logits"], weights_only=True)
    tokens = torch.tensor([case["tokens"]])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0]
    diff = float((logits - expected).abs().max())
    if diff > 1e-5 * float(expected.abs().max()):
        problems.append(f"logits differ by {diff}")
    encoded = tokenizer(case["texts"][0], return_tensors="pt")
    generated = model.generate(**encoded, max_new_tokens=3, do_sample=False)
    if generated.shape[1] != encoded["input_ids"].shape[1] + 3:
        problems.append(f"generate gave shape {tuple(generated.shape)}")
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = pipe(case["texts"][0], max_new_tokens=2, do_sample=False)[0]["generated_text"]
    if not text.startswith(case["texts"][0]):
        problems.append(f"pipeline gave {text!r}")
    return problems


def main() -> None:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    problems = {c["name"]: check(c) for c in cases}
    print(json.dumps({"transformers": transformers.__version__, "problems": problems}))
    sys.exit(1 if any(problems.values()) else 0)


if __name__ == "__main__":
    main()
