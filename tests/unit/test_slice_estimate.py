"""What each engine rank receives with slices, for `ckpt-engine plan`: estimated from a checkpoint's
names, shapes and config.json by vLLM's loader conventions, or exact from a recorded plan. (The real
vLLM-CPU tests check the estimate against the plans vLLM's loaders record: test_vllm_slices.)"""

import json
import math

import pytest
import torch

from ckpt_core import cli
from ckpt_core.checkpoint.safetensors import write_file
from ckpt_core.errors import ConfigError
from ckpt_core.planning.slice_estimate import estimate, from_plan
from ckpt_core.planning.slices import SliceKey, split_plan, write_plan_file

F32 = 4
# A one-layer MoE: vocabulary 333 (padded to 384 rows), 2 KV heads of 8, 4 experts.
SHAPES = {
    "model.embed_tokens.weight": (333, 8),
    "model.layers.0.input_layernorm.weight": (8,),
    "model.layers.0.self_attn.q_proj.weight": (32, 8),
    "model.layers.0.self_attn.k_proj.weight": (16, 8),
    "model.layers.0.self_attn.k_proj.bias": (16,),
    "model.layers.0.mlp.gate.weight": (4, 8),
    **{f"model.layers.0.mlp.experts.{e}.down_proj.weight": (8, 16) for e in range(4)},
}
CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4}


def _tensors():
    return {n: (s, F32) for n, s in SHAPES.items()}


def test_each_tensor_is_split_by_the_loader_convention_for_its_kind():
    load = estimate(_tensors(), CONFIG, 4)
    vocab_rows = [96, 96, 96, 45]                            # 384 padded rows in 4; rank 3 has 333 - 288 of them
    for r in range(4):
        want = (vocab_rows[r] * 8 * F32                       # embed_tokens: its rows of the padded vocabulary
                + 8 * F32                                     # the norm, whole
                + 32 * 8 * F32 // 4                           # q_proj: a quarter
                + (16 * 8 + 16) * F32 // 2                    # k_proj and its bias: one of 2 KV heads (T > nkv)
                + 4 * 8 * F32                                 # the router, whole
                + 4 * 8 * 16 * F32 // 4)                      # each expert split like a dense MLP
        assert load.received_bytes[r] == want, r
    assert load.tensors == (len(SHAPES),) * 4
    assert load.everywhere_bytes == (8 + 4 * 8) * F32       # the norm and the router only
    assert not load.ep and "estimate" in load.source


def test_under_expert_parallelism_each_rank_reads_its_experts_whole_and_no_other():
    tp, ep = estimate(_tensors(), CONFIG, 4), estimate(_tensors(), CONFIG, 4, ep=True)
    assert ep.tensors == (len(SHAPES) - 3,) * 4              # one of the four experts each
    assert ep.received_bytes == tp.received_bytes              # 1/4 of the expert bytes either way, here
    two = estimate(_tensors(), CONFIG, 2, ep=True)
    assert two.tensors == (len(SHAPES) - 2,) * 2
    with pytest.raises(ConfigError, match="divisible by 3"):
        estimate(_tensors(), CONFIG, 3, ep=True)
    with pytest.raises(ConfigError, match="expert count"):
        estimate(_tensors(), {"num_key_value_heads": 2}, 2, ep=True)


def test_one_rank_reads_everything_and_every_kv_head_is_split_when_there_are_enough():
    one = estimate(_tensors(), CONFIG, 1)
    total = sum(math.prod(s) * F32 for s in SHAPES.values())
    assert one.received_bytes == (total,) and one.everywhere_bytes == total
    two = estimate(_tensors(), CONFIG, 2)                      # nkv = T: k_proj split, not replicated
    assert two.received_bytes[0] - two.received_bytes[1] == (192 - 141) * 8 * F32   # only the vocabulary differs


def test_a_recorded_plan_gives_exact_figures_per_rank():
    tensors = {n: ("F32", s, F32) for n, s in SHAPES.items()}
    plan = split_plan(SliceKey("m", "tp=2", "test"), tensors, 2, {"model.layers.0.self_attn.q_proj.weight": 0,
                                                                  "model.embed_tokens.weight": 1})
    load = from_plan(plan)
    assert load.received_bytes == (plan.rank_bytes(0), plan.rank_bytes(1)) and load.tp == 2
    split = (32 * 8 + 333 * 8) * F32
    assert load.everywhere_bytes == sum(math.prod(s) * F32 for s in SHAPES.values()) - split
    assert load.received_bytes[0] == load.everywhere_bytes + split // 2 and plan.digest[:12] in load.source


@pytest.fixture
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(24)
    path = tmp_path / "model.safetensors"
    write_file(str(path), {n: torch.randn(*s, generator=gen) for n, s in SHAPES.items()})
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return path


def _plan(capsys, *argv) -> dict:
    assert cli.main(["--json", "plan", "--devices", "4", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_estimates_slices_from_the_checkpoint_and_takes_a_recorded_plan_exactly(checkpoint, capsys):
    doc = _plan(capsys, "--model", str(checkpoint), "--slices-tp", "4")
    assert doc["with_slices"]["slices"]["received_bytes"] == list(estimate(_tensors(), CONFIG, 4).received_bytes)
    assert doc["with_slices"]["received_bytes_per_rank"] < doc["received_bytes_per_rank"] / 2
    ep = _plan(capsys, "--model", str(checkpoint), "--slices-tp", "4", "--slices-ep")["with_slices"]["slices"]
    assert ep["ep"] and ep["tensors"] == [len(SHAPES) - 3] * 4
    coarse = _plan(capsys, "--model", str(checkpoint), "--slices-tp", "4", "--sharded-fraction", "0.5")
    assert coarse["with_slices"]["slices"]["source"] == "0.5 of the bytes sharded"

    tensors = {n: ("F32", s, F32) for n, s in SHAPES.items()}
    plan = split_plan(SliceKey("m", "tp=4", "vllm-test"), tensors, 4, {"model.layers.0.self_attn.q_proj.weight": 0})
    write_plan_file(checkpoint.parent / "plan.json", plan)
    recorded = _plan(capsys, "--model", str(checkpoint), "--slices-plan", str(checkpoint.parent / "plan.json"))
    assert recorded["with_slices"]["slices"]["received_bytes"] == [plan.rank_bytes(r) for r in range(4)]
    assert cli.main(["plan", "--size-gib", "1", "--tensors", "10", "--devices", "4",
                     "--slices-plan", str(checkpoint.parent / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert f"with slices (TP 4, recorded plan {plan.digest[:12]} (vllm-test, tp=4))" in out
    assert "per engine rank:" in out and "read whole by every rank" in out


@pytest.mark.parametrize("argv, needle", [
    (["--size-gib", "1", "--tensors", "10", "--slices-tp", "4", "--slices-ep"], "--slices-ep needs the checkpoint"),
    (["--size-gib", "1", "--tensors", "10", "--slices-tp", "2", "--slices-plan", "PLAN"], "has 4 engine ranks"),
    (["--size-gib", "1", "--tensors", "10", "--slices-plan", "BAD"], "cannot read the slice plan"),
    (["--size-gib", "1", "--tensors", "10", "--slices-tp", "3"], "not a multiple of the engine's 3"),
])
def test_a_bad_slices_request_to_plan_is_a_config_error_naming_it(argv, needle, tmp_path, capsys):
    tensors = {n: ("F32", s, F32) for n, s in SHAPES.items()}
    write_plan_file(tmp_path / "plan.json", split_plan(SliceKey("m", "tp=4", "t"), tensors, 4, {}))
    (tmp_path / "bad.json").write_text("{not json")
    argv = [{"PLAN": str(tmp_path / "plan.json"), "BAD": str(tmp_path / "bad.json")}.get(a, a) for a in argv]
    assert cli.main(["--json", "plan", "--devices", "4", *argv]) == cli.EXIT_CONFIG
    assert needle in json.loads(capsys.readouterr().out)["error"]["message"]


def test_a_guessed_largest_tensor_that_does_not_fit_says_to_give_it(capsys):
    assert cli.main(["--json", "plan", "--size-gib", "438", "--tensors", "36945", "--devices", "8"]) == cli.EXIT_CONFIG
    assert "is a guess (1/16 of the model): give --largest-mib" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert cli.main(["--json", "plan", "--size-gib", "438", "--tensors", "36945", "--largest-mib", "1187",
                     "--devices", "8"]) == 0
