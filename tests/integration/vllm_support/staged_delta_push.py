"""Staged sliced deltas into one vLLM server, with one PS rank per engine worker.

Run under torchrun (``--nproc-per-node`` = the server's tensor-parallel size), in the project venv:

    staged_delta_push.py --endpoint URL --prompts JSON --max-tokens N FILE [FILE ...]

Each PS rank registers its share of every version (``v0``, then ``v1`` against ``v0``, ...; the
tensors dealt round-robin by name) and of ``v0``'s file again as ``v0-again`` (the same bytes under
another version name). Every update is routed by the slice plan the workers record for ``v0``
(``VllmClient.slice_plan``, shared by rank 0), except the one said whole. The steps:

1. ``v0`` sliced, with ``deltas=True``: the base.
2. Two commits refused because the engine's base changed after the stage: ``v1``'s sliced delta
   staged, then the engine given ``v0-again`` (another version) before the commit; ``v0`` again,
   ``v1``'s delta staged, then ``v0`` given whole without slices (its base now kept unsliced) before
   the commit; then ``v1``'s sliced delta staged again, refused at the stage for that reason. The
   engine holds ``v0``'s bytes throughout.
3. ``v0`` sliced again; then each later version's sliced delta staged (the live engine unchanged
   while it is) and committed by ``VllmClient.commit``.

After each step rank 0 prints one JSON line: ``{"step", "holds"`` (the version whose bytes the
engine must hold now), ``"ok"``, ``"error"`` and ``"message"`` (a refused step), ``"ps"`` (the PS's
result), ``"engine"`` (the workers' replies), ``"digests"`` (``ckpt_state_digests``), ``"tokens"``
(greedy completions of the prompts)}.
"""

from __future__ import annotations

import argparse
import json
import os

from delta_push import completions, emit  # this script's directory is on sys.path
from safetensors.torch import load_file

from ckpt_core import ParameterServer
from ckpt_core.errors import CkptError
from ckpt_vllm import VllmClient


class Steps:
    """One PS rank's part of the steps; rank 0 posts to the server and prints the lines."""

    def __init__(self, ps: ParameterServer, client: VllmClient, plan, args) -> None:
        self.ps, self.client, self.plan, self.args = ps, client, plan, args
        self.leader = ps.rank == 0

    def _line(self, step: str, holds: str, **fields) -> None:
        if self.leader:
            emit({"step": step, "holds": holds, **fields, "digests": self.client.collective_rpc("ckpt_state_digests"),
                  "tokens": completions(self.args.endpoint, self.args.prompts, self.args.max_tokens)})

    def full(self, name: str, holds: str | None = None, sliced: bool = True) -> None:
        """A full update of ``name`` with ``deltas=True`` (the workers map and keep it as the next base)."""
        replies: list = []

        def req(handles):
            if self.leader:
                replies.append(self.client.update(handles, version=name, deltas=True, timeout=300,
                                                  slices=self.plan if sliced else None).workers)

        result = self.ps.update(name, req, timeout=300, slices=self.plan if sliced else None)
        self._line(f"full {name}" + ("" if sliced else " unsliced"), holds or name, ok=True, ps=result,
                   engine=replies[0] if replies else None)

    def stage(self, name: str, holds: str) -> None:
        """``name``'s sliced delta staged while the engine serves; the live weights stay ``holds``. A
        refused stage is a line too, with every rank's error (``"errors"``)."""
        replies: list = []

        def req(handles):
            if self.leader:
                replies.append(self.client.stage(handles, name, deltas=True, slices=self.plan, timeout=300).workers)

        try:
            fields = {"ok": True, "ps": self.ps.update(name, req, timeout=300, delta=True, slices=self.plan),
                      "engine": replies[0] if replies else None}
        except CkptError as exc:
            fields = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        fields["errors"] = [v["error"] for v in self.ps.all_gather_json({"error": fields.get("error")})]
        self._line(f"stage {name}", holds, **fields)

    def commit(self, name: str, holds: str) -> None:
        """Rank 0 commits the staged ``name`` (not collective); the ranks meet afterwards."""
        if self.leader:
            try:
                fields = {"ok": True, "engine": self.client.commit(name, timeout=300).workers}
            except CkptError as exc:
                fields = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            self._line(f"commit {name}", holds, **fields)
        self.ps.all_gather_json({"committed": name})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--prompts", type=json.loads, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = VllmClient(args.endpoint, timeout=300)
    names = [f"v{i}" for i in range(len(args.files))]
    with ParameterServer(device="cpu") as ps:
        for name, path, base in [*zip(names, args.files, [None, *names]), ("v0-again", args.files[0], None)]:
            tensors = load_file(path)
            ps.register_checkpoint(name, named_tensors={n: tensors[n] for n in sorted(tensors)[rank::world]},
                                   base=base)
            ps.gather_metas(name)
        plan = ps.share_slice_plan(client.slice_plan(ps.tensor_specs("v0")) if rank == 0 else None)
        steps = Steps(ps, client, plan, args)
        steps.full("v0")
        steps.stage("v1", holds="v0")
        steps.full("v0-again", holds="v0")        # another version made live after the stage
        steps.commit("v1", holds="v0")            # refused: the base is gone
        steps.full("v0")
        steps.stage("v1", holds="v0")
        steps.full("v0", sliced=False)            # the same version, kept whole now
        steps.commit("v1", holds="v0")            # refused: the base is kept by another slicing
        steps.stage("v1", holds="v0")             # refused at once, for the same reason: nothing staged
        steps.full("v0")
        for prev, name in zip(names, names[1:]):
            steps.stage(name, holds=prev)
            steps.commit(name, holds=name)


if __name__ == "__main__":
    main()
