"""Build a tiny model (Qwen2, Llama, Qwen3, Qwen3-MoE, Mixtral) locally and compute Hugging Face greedy references.

Runs as a script under the vLLM venv's python (transformers and tokenizers live there), so the
project venv needs neither. No hub access: the tokenizer is trained here with `tokenizers`.

    python tiny_model.py build --out DIR [--seed N] [--variants K] [--tie] [--family F] [--vocab V]
                               [--config-json JSON]
        config, tokenizer, and K sets of random weights DIR/weights-{i}.safetensors (seed N+i);
        DIR/model.safetensors holds set 0; --tie: lm_head shares embed_tokens' weight
    python tiny_model.py reference --model DIR [--weights FILE ...] --prompts JSON --max-tokens N

`reference` prints one JSON line: {weights file: [greedy continuation (token ids) of each
prompt]}, computed by argmax over the full-sequence logits with no EOS stop, the same thing a
vLLM request with temperature 0 and ignore_eos returns. Without --weights: DIR's own weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Small, but within what vLLM-CPU attention supports: head_dim must be 32/64/80/96/112/128...
CONFIG = dict(
    vocab_size=384,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 64
    num_key_value_heads=1,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
# Model families (transformers config class, extra config). qwen2 has q/k/v biases, qwen3 q/k
# norms; the MoE intermediate sizes are multiples of 32 (vLLM-CPU's grouped-GEMM alignment).
FAMILIES = {
    "qwen2": ("Qwen2Config", {}),
    "llama": ("LlamaConfig", {"head_dim": 64}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 64}),
}
_CORPUS_WORDS = (
    "the quick brown fox jumps over a lazy dog while parameter servers push new weights into "
    "running inference engines many times a day without restarting them and every worker "
    "copies each bucket into its own parameters before acknowledging the update"
).split()


def _train_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def _random_model(model_dir: Path, seed: int):
    """A model of ``model_dir``'s config with fresh random weights. The std is large enough that
    greedy argmax has clear winners: with the usual 0.02 init, logits nearly tie and float noise
    could flip them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
    return model.eval()


def build(out: Path, seed: int, variants: int = 1, tie: bool = False, family: str = "qwen2",
          vocab: int | None = None, overrides: dict | None = None) -> None:
    """Config, tokenizer and ``variants`` random checkpoints, each in the layout transformers'
    ``save_pretrained`` writes (per-expert tensors for MoE; no ``lm_head.weight`` when tied)."""
    import shutil
    import tempfile

    import transformers

    out.mkdir(parents=True, exist_ok=True)
    cls_name, extra = FAMILIES[family]
    vocab = vocab or CONFIG["vocab_size"]
    cfg = getattr(transformers, cls_name)(**{**CONFIG, **extra, "vocab_size": vocab, "tie_word_embeddings": tie,
                                             **(overrides or {})}, bos_token_id=1, eos_token_id=1)
    cfg.save_pretrained(out)
    _train_tokenizer(out, vocab)
    for i in range(max(variants, 1)):
        with tempfile.TemporaryDirectory() as tmp:
            _random_model(out, seed + i).save_pretrained(tmp)
            shutil.move(str(Path(tmp) / "model.safetensors"), str(out / f"weights-{i}.safetensors"))
            if i == 0:   # the model's own config names its architecture (XForCausalLM)
                shutil.copyfile(Path(tmp) / "config.json", out / "config.json")
        if i == 0:
            shutil.copyfile(out / "weights-0.safetensors", out / "model.safetensors")


def _load_hf(model_dir: Path, weights_file: Path | None):
    """transformers' model with ``weights_file`` loaded as a checkpoint of ``model_dir``'s config
    (``from_pretrained`` converts the on-disk layout, e.g. per-expert tensors, as for any hub model)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    if weights_file is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").symlink_to(model_dir / "config.json")
        (Path(tmp) / "model.safetensors").symlink_to(Path(weights_file).resolve())
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)


def reference(model_dir: Path, weights_file: Path | None, prompts: list[list[int]],
              max_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by transformers with ``weights_file`` loaded."""
    import torch

    model = _load_hf(model_dir, weights_file).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(max_tokens):
                nxt = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            outs.append(ids[0, len(prompt):].tolist())
    return outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--variants", type=int, default=1)
    b.add_argument("--tie", action="store_true")
    b.add_argument("--family", choices=sorted(FAMILIES), default="qwen2")
    b.add_argument("--vocab", type=int, default=None)
    b.add_argument("--config-json", type=json.loads, default=None, help="JSON object overriding config fields")
    r = sub.add_parser("reference")
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--weights", type=Path, nargs="*", default=[])
    r.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    r.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args.out, args.seed, args.variants, args.tie, args.family, args.vocab, args.config_json)
    else:
        prompts = json.loads(args.prompts)
        out = {str(w) if w else "": reference(args.model, w, prompts, args.max_tokens)
               for w in (args.weights or [None])}
        sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
