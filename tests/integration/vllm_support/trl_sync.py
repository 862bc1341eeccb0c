"""TRL's real AsyncGRPOTrainer syncs its policy into a vLLM server through ckpt_vllm.trl.CkptWeightTransfer.

Runs under the TRL venv's python (scripts/trl_env.sh), this repo first on PYTHONPATH:

    python trl_sync.py --model DIR --url URL --out DIR --prompts JSON [--syncs 3] [--stage-syncs 2]
                       [--modes plain,stage] [--timeout S]

AsyncGRPOTrainer cannot train on CPU (its tree attention is a FlashAttention-3 kernel fetched from
the hub), so the policy changes between syncs by a seeded perturbation of every parameter instead
of an optimizer step; everything that moves the weights is TRL's own code: the trainer is built
with ``weight_transfer=CkptWeightTransfer(url)`` and a stub rollout worker, its train-begin callback
(``init_weight_transfer`` + the cold sync) runs first, then ``_sync_weight`` (what TRL's
``StepIntervalCallback`` calls every ``weight_sync_steps``: pause, ``send_weights(_streaming_iter())``,
resume). ``--modes``: one trainer per mode, one after the other in this process (TRL's import
dominates): ``plain`` (``CkptWeightTransfer(url)``), ``stage`` (``stage=True``). After each sync, one
JSON line: the mode, the policy saved to ``OUT/<mode>-sync-<k>.safetensors``, every worker's
digests, the server's greedy completions, TRL's model version and the adapter's phases.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_trainer import greedy  # noqa: E402  (the same completions request as the trainer-API test)


class StubRolloutWorker:
    """TRL's RolloutWorkerProtocol, producing nothing: only the weight sync is exercised."""

    def __init__(self):
        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        self.versions: list[int] = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version: int):
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float):
        pass


def build_trainer(model_dir: Path, url: str, out: Path, transfer):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer

    # Its MFU metric asks CUDA for the device's name; on CPU there is none (a metric only: no weight
    # moves through it).
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: 1.0

    config = AsyncGRPOConfig(output_dir=str(out / "trl"), vllm_server_base_url=url, report_to=[], bf16=False,
                             use_cpu=True, dtype="float32", max_steps=3, logging_steps=1, save_strategy="no")
    return AsyncGRPOTrainer(model=str(model_dir), reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                            args=config, train_dataset=Dataset.from_dict({"prompt": ["the quick brown fox"] * 4}),
                            processing_class=AutoTokenizer.from_pretrained(model_dir),
                            rollout_worker=StubRolloutWorker(), weight_transfer=transfer)


def perturb(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=json.loads, required=True)
    ap.add_argument("--syncs", type=int, default=3, help="syncs of the plain trainer")
    ap.add_argument("--stage-syncs", type=int, default=2, help="syncs of the stage=True trainer (the first is "
                    "train begin's, the others _sync_weight's)")
    ap.add_argument("--modes", default="plain,stage", help="comma-separated: plain, stage")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params, _TrainBeginCallback

    from ckpt_vllm import VllmClient
    from ckpt_vllm.trl import CkptWeightTransfer

    torch.set_num_threads(1)
    inspect = VllmClient(args.url, timeout=120.0)
    for m, mode in enumerate(args.modes.split(",")):
        if mode not in ("plain", "stage"):
            raise SystemExit(f"unknown mode {mode!r}")
        transfer = CkptWeightTransfer(args.url, stage=mode == "stage", timeout_s=args.timeout)
        trainer = build_trainer(args.model, args.url, args.out / mode, transfer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        begin = next(c for c in trainer.callback_handler.callbacks if isinstance(c, _TrainBeginCallback))
        for k in range(args.syncs if mode == "plain" else args.stage_syncs):
            perturb(model, args.seed * 100 + 10 * m + k)
            file = args.out / f"{mode}-sync-{k}.safetensors"
            save_file({n: p.detach().clone().contiguous() for n, p in _iter_vllm_named_params(model)}, str(file))
            t0 = time.monotonic()
            if k == 0:   # train begin: init_weight_transfer, the cold sync, the rollout worker's start
                begin.on_train_begin(trainer.args, trainer.state, trainer.control)
            else:        # every weight_sync_steps optimizer steps
                trainer._sync_weight()
            line = {"mode": mode, "sync": k, "file": str(file), "seconds": time.monotonic() - t0,
                    "phases": dict(transfer.seconds), "model_version": trainer.model_version,
                    "paused": inspect.is_paused(), "digests": inspect.collective_rpc("ckpt_state_digests"),
                    "tokens": greedy(args.url, args.prompts), "versions": inspect.weight_versions()}
            print(json.dumps(line), flush=True)
        transfer.destroy()
        transfer.destroy()   # idempotent
    inspect.close()

if __name__ == "__main__":
    main()
