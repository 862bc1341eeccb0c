"""How many bf16 elements does one AdamW step change? (issue 39, item 5)

Trains a small Qwen2-shaped decoder built here (random init, random tokens; no download, torch
only) with AdamW in float32 master weights, as trainers do, and after every step casts the weights
to bf16 (what an engine is sent) and compares them byte for byte with the previous step's bf16.
Records, per learning rate and step, the fraction of changed elements overall and per tensor kind
(embed, q/k/v weights and biases, o, gate/up/down, norms, lm_head), and what the delta encoding
(``ckpt_core.delta.encode``) makes of each step: payload bytes against the full checkpoint, the
encodings chosen, and the time to encode and to decode + apply on this CPU.

    python benchmarks/delta_density.py --out benchmarks/results/2026-12-03-cpu-delta-density.json

The shape is Qwen2's (GQA attention with q/k/v biases, SwiGLU MLP, RMSNorm, untied lm_head),
scaled down: ``--hidden 512 --layers 4`` is 15 M parameters. Initialization as Qwen2's config
(normal, std 0.02; norms 1).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from ckpt_core.delta.encode import apply_decoded, changed_mask, decode, encode_tensor   # noqa: E402
from ckpt_core.delta.encode_device import encode_on_device   # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.hd, bias=True)
        self.k_proj = nn.Linear(hidden, kv_heads * self.hd, bias=True)
        self.v_proj = nn.Linear(hidden, kv_heads * self.hd, bias=True)
        self.o_proj = nn.Linear(heads * self.hd, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden, inter, heads, kv_heads):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
        self.self_attn, self.mlp = Attention(hidden, heads, kv_heads), MLP(hidden, inter)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Like(nn.Module):
    """Qwen2ForCausalLM's parameter names and shapes (``model.layers.N.self_attn.q_proj.weight``...)."""

    def __init__(self, vocab, hidden, inter, layers, heads, kv_heads):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(Layer(hidden, inter, heads, kv_heads) for _ in range(layers))
        self.model.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.hd = hidden // heads
        for name, p in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)

    def forward(self, ids):
        s = ids.shape[1]
        inv = 1.0 / (1e6 ** (torch.arange(0, self.hd, 2, device=ids.device).float() / self.hd))   # Qwen2's theta
        ang = torch.outer(torch.arange(s, device=ids.device).float(), inv)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def kind_of(name: str) -> str:
    for pat, kind in ((r"embed_tokens", "embed"), (r"lm_head", "lm_head"), (r"norm", "norm"),
                      (r"(q|k|v)_proj\.bias", r"\1_bias"), (r"(q|k|v|o)_proj\.weight", r"\1_proj"),
                      (r"(gate|up|down)_proj", r"\1_proj")):
        m = re.search(pat, name)
        if m:
            return m.expand(kind)
    return "other"


def bf16_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_figures(prev: dict, cur: dict) -> dict:
    """Changed fraction per kind, and the delta encoding's size and times for this step. On a GPU the
    step's tensors are encoded together where they lie (``encode_device.encode_on_device``, the path of a
    trainer's ``on_device`` versions); on the CPU one by one on the host (``encode_tensor``)."""
    changed, total = defaultdict(int), defaultdict(int)
    enc_s = apply_s = 0.0
    payload_bytes, full_bytes, encodings = 0, 0, defaultdict(int)
    device = next(iter(cur.values())).device
    if device.type != "cpu":
        _sync(device)
        t0 = time.perf_counter()
        encoded = dict(zip(cur, encode_on_device([(new, prev[n]) for n, new in cur.items()])))
        _sync(device)
        enc_s = time.perf_counter() - t0
    for name, new in cur.items():
        kind = kind_of(name)
        n = int(changed_mask(new, prev[name]).sum())
        changed[kind] += n
        total[kind] += new.numel()
        full_bytes += new.numel() * new.element_size()
        if device.type == "cpu":
            t0 = time.perf_counter()
            payload, info = encode_tensor(new, prev[name])
            enc_s += time.perf_counter() - t0
        else:
            payload, info = encoded[name]
        encodings[info["encoding"] or "unchanged"] += 1
        if payload is not None:
            payload_bytes += payload.numel()
            live = prev[name].clone()
            t0 = time.perf_counter()
            apply_decoded(live, decode(payload, name))
            _sync(device)
            apply_s += time.perf_counter() - t0
            assert torch.equal(live.view(torch.int16), new.view(torch.int16)), name   # lossless, checked here too
    all_changed, all_total = sum(changed.values()), sum(total.values())
    return {"changed_fraction": all_changed / all_total,
            "by_kind": {k: changed[k] / total[k] for k in sorted(total)},
            "payload_bytes": payload_bytes, "full_bytes": full_bytes, "payload_fraction": payload_bytes / full_bytes,
            "encodings": dict(encodings), "encode_s": enc_s, "decode_apply_s": apply_s}


def run(args) -> dict:
    device = torch.device(args.device)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"date": args.date, "machine": machine, "cpu": platform.processor() or platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "model": {k: getattr(args, k) for k in ("vocab", "hidden", "inter", "layers", "heads", "kv_heads")},
               "batch": args.batch, "seq": args.seq, "steps": args.steps, "optimizer": "AdamW(betas=(0.9, 0.999), "
               f"eps=1e-8, weight_decay={args.wd}), float32 master weights, bf16 snapshot per step", "runs": {}}
    for lr in args.lrs:
        torch.manual_seed(args.seed)
        model = Qwen2Like(args.vocab, args.hidden, args.inter, args.layers, args.heads, args.kv_heads).to(device)
        results["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.wd)
        gen = torch.Generator().manual_seed(args.seed + 1)
        prev = bf16_state(model)
        steps = []
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            cur = bf16_state(model)
            fig = step_figures(prev, cur)
            fig.update(step=step, loss=float(loss.detach()))
            steps.append(fig)
            print(f"lr {lr:g} step {step}: loss {fig['loss']:.4f} changed {fig['changed_fraction']:.4%} payload "
                  f"{fig['payload_fraction']:.4%} of {fig['full_bytes'] / 1e6:.1f} MB; encode {fig['encode_s']:.3f} s, "
                  f"decode+apply {fig['decode_apply_s']:.3f} s; {fig['encodings']}", flush=True)
            prev = cur
        results["runs"][f"{lr:g}"] = steps
    return results


def codec_table(densities: list[float], numel: int, repeats: int = 3) -> list[dict]:
    """The encoding of one bf16 tensor of ``numel`` elements at each density (changed elements at random
    positions): payload bytes against the tensor, the encoding chosen, and the best of ``repeats`` times to
    encode (diff, positions, values, the digest of the new bytes: SHA-256 until 2026-12-03, lin64 since) and
    to decode + check + scatter."""
    gen = torch.Generator().manual_seed(12)
    base = (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16)
    rows = []
    for density in densities:
        new = base.clone()
        pos = torch.randperm(numel, generator=gen)[: int(numel * density)]
        new.view(torch.int16)[pos] ^= 1
        enc_s = apply_s = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            payload, info = encode_tensor(new, base)
            enc_s = min(enc_s, time.perf_counter() - t0)
            live = base.clone()
            t0 = time.perf_counter()
            apply_decoded(live, decode(payload))
            apply_s = min(apply_s, time.perf_counter() - t0)
        assert torch.equal(live.view(torch.int16), new.view(torch.int16))
        rows.append({"density": density, "encoding": info["encoding"], "payload_bytes": payload.numel(),
                     "tensor_bytes": numel * 2, "payload_fraction": payload.numel() / (numel * 2),
                     "encode_s": enc_s, "decode_apply_s": apply_s})
        print(f"codec: density {density:.4%}: {info['encoding']}, payload {payload.numel() / (numel * 2):.4f} of "
              f"{numel * 2 / 2**20:.0f} MiB; encode {enc_s:.3f} s, decode+apply {apply_s:.3f} s", flush=True)
    return rows


def summary(results: dict) -> str:
    if not results["runs"]:
        lines = [f"# delta codec, {results['date']}, {results['machine']}"]
        kinds = []
    else:
        lines = [f"# delta density, {results['date']}, {results['machine']} ({results['cpu']}), torch {results['torch']}, "
                 f"{results['params'] / 1e6:.1f} M params, {results['optimizer']}"]
        kinds = sorted(next(iter(results["runs"].values()))[0]["by_kind"])
        lines.append("lr | steps 2..N mean changed | step 1 | payload/full (mean) | " + " | ".join(kinds))
    for lr, steps in results["runs"].items():
        later = steps[1:] or steps
        mean = sum(s["changed_fraction"] for s in later) / len(later)
        pay = sum(s["payload_fraction"] for s in later) / len(later)
        per = [sum(s["by_kind"][k] for s in later) / len(later) for k in kinds]
        lines.append(f"{lr} | {mean:.4%} | {steps[0]['changed_fraction']:.4%} | {pay:.4%} | "
                     + " | ".join(f"{p:.3%}" for p in per))
    for row in results.get("codec", []):
        lines.append(f"codec, one bf16 tensor of {row['tensor_bytes'] / 2**20:.0f} MiB at density {row['density']:.4%}: "
                     f"{row['encoding']}, payload {row['payload_fraction']:.4f} of the tensor, encode "
                     f"{row['encode_s']:.3f} s, decode+apply {row['decode_apply_s']:.3f} s")
    return "\n".join(lines)


def report(results: dict, text: str, out) -> None:
    """Print ``text``; with ``out`` (a path), write ``results`` there as JSON and ``text`` beside it (.txt)."""
    print(text)
    if out is not None:
        out.write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".txt").write_text(text + "\n")


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model's shape, the batch, the seed and the date (shared with ``delta_p2p.py``)."""
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lrs", type=float, nargs="*", default=[1e-6, 1e-5, 1e-4])
    ap.add_argument("--steps", type=int, default=8)
    model_arguments(ap)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--codec-densities", type=float, nargs="*", default=[0.001, 0.005, 0.015, 0.03, 0.1, 0.3, 0.6],
                    help="also time the encoding of one bf16 tensor at these densities")
    ap.add_argument("--codec-mib", type=int, default=64, help="that tensor's size, MiB")
    ap.add_argument("--device", default="cpu", help="train (and encode the deltas) there: cpu, or cuda "
                    "(a larger model: e.g. --hidden 2048 --inter 5632 --layers 16 --vocab 32000)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here (and a .txt summary beside)")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--device {args.device}: no such device here (cpu, or cuda on a machine with a GPU)")
    if args.steps < 1 or args.steps > 1000 or not all(0 < lr < 1 and math.isfinite(lr) for lr in args.lrs):
        ap.error("--steps must be in [1, 1000] and every --lrs in (0, 1)")
    if not 1 <= args.codec_mib <= 4096 or not all(0 <= d <= 1 for d in args.codec_densities):
        ap.error("--codec-mib must be in [1, 4096] and every --codec-densities in [0, 1]")
    results = run(args) if args.lrs else {"date": args.date, "machine": "cpu", "runs": {}}
    if args.codec_densities:
        results["codec"] = codec_table(args.codec_densities, args.codec_mib << 19)
    report(results, summary(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
