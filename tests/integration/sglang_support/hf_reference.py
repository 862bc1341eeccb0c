"""Greedy continuations by Hugging Face transformers' Qwen2 with a checkpoint directory's weights.

Runs under the SGLang venv's python (the project venv has no transformers)::

    python -m sglang_support.hf_reference --ckpt DIR [--ckpt DIR2 ...] --prompts '[[1, 2], ...]' --max-new N

prints ``{DIR: [[token, ...] per prompt]}`` as JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def greedy(ckpt: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(AutoConfig.from_pretrained(ckpt)).eval()
    state = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", action="append", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new", type=int, required=True)
    args = ap.parse_args()
    prompts = json.loads(args.prompts)
    print(json.dumps({c: greedy(Path(c), prompts, args.max_new) for c in args.ckpt}))


if __name__ == "__main__":
    main()
