"""`ckpt-engine` inspect and plan: typed errors and exit codes, never a traceback, on bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_core import cli
from ckpt_core.checkpoint.safetensors import write_file
from support.cli_runner import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _good(path, gen=torch.Generator().manual_seed(16)):
    write_file(str(path), {"embed": torch.randn(500, 64, generator=gen), "norm": torch.randn(64, generator=gen).half()})
    return str(path)


def _hostile(kind: str, path) -> str:
    good = open(_good(path), "rb").read()
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    if kind == "huge header length":
        data = (1 << 62).to_bytes(8, "little") + good[8:]
    elif kind == "truncated data":
        data = good[:-100]
    elif kind == "header not json":
        data = n.to_bytes(8, "little") + b"{" * n + good[8 + n:]
    elif kind == "overlapping tensors":
        header["norm"]["data_offsets"] = [0, 128]
        body = json.dumps(header).encode()
        data = len(body).to_bytes(8, "little") + body + good[8 + n:]
    elif kind == "empty file":
        data = b""
    else:
        raise AssertionError(kind)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


HOSTILE = ["huge header length", "truncated data", "header not json", "overlapping tensors", "empty file"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_inspect_of_a_hostile_file_exits_3_with_the_typed_error_and_no_traceback(kind, tmp_path):
    path = _hostile(kind, tmp_path / "model.safetensors")
    proc = run_cli("--json", "inspect", path, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))   # a process of its own
    assert proc.returncode == cli.EXIT_FORMAT, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    err = json.loads(proc.stdout)["error"]
    assert err["type"] == "CheckpointFormatError" and path in err["message"], err
    assert "CheckpointFormatError" in proc.stderr


def test_inspect_reports_tensors_dtypes_and_the_bucket_plan(tmp_path, capsys):
    path = _good(tmp_path / "m.safetensors")
    assert cli.main(["--json", "inspect", path, "--device-mem-gib", "1", "--ranks", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["valid"] and doc["tensors"] == 2 and doc["bytes"] == 500 * 64 * 4 + 64 * 2
    assert doc["dtypes"] == {"float32": {"tensors": 1, "bytes": 128000}, "float16": {"tensors": 1, "bytes": 128}}
    assert doc["largest_tensor"]["name"] == "embed" and doc["plan"]["ranks"] == 2 and doc["plan"]["buckets"] >= 2


def test_inspect_of_a_hf_directory_validates_every_shard(tmp_path, capsys):
    _good(tmp_path / "a.safetensors")
    _hostile("truncated data", tmp_path / "b.safetensors")
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_FORMAT
    assert "b.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, needle", [
    (["inspect", "/no/such/file"], cli.EXIT_CONFIG, "no such file"),
    (["plan"], cli.EXIT_CONFIG, "--size-gib"),
    (["plan", "--size-gib", "100", "--tensors", "10", "--largest-mib", "60000", "--device-free-gib", "16"],
     cli.EXIT_CONFIG, "largest tensor"),
])
def test_bad_arguments_exit_4_with_a_message(argv, code, needle, capsys):
    assert cli.main(argv) == code
    assert needle in capsys.readouterr().err


def test_an_unknown_flag_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--frobnicate"])
    assert exc.value.code == cli.EXIT_USAGE


@pytest.mark.parametrize("wire", ["stock4", "", "NATIVE"])
def test_serve_refuses_an_unknown_wire_as_a_usage_error(wire, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--wire", wire])
    assert exc.value.code == cli.EXIT_USAGE
    assert "--wire" in capsys.readouterr().err


def test_serve_offers_exactly_the_parameter_servers_wires():
    from ckpt_core.wire.stock import WIRES
    assert set(cli.SERVE_WIRES) == set(WIRES)
    assert cli.build_parser().parse_args(["serve"]).wire == "native"
    assert cli.build_parser().parse_args(["serve", "--wire", "stock-0.3"]).wire == "stock-0.3"


def test_plan_prints_stages_memory_and_json(tmp_path, capsys):
    assert cli.main(["--json", "plan", "--size-gib", "16", "--tensors", "387", "--devices", "2",
                     "--device-free-gib", "130"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["stages_s"]) == {"h2d", "broadcast", "reload"} and doc["bottleneck"] == "h2d"
    assert 0.1 < doc["update_s"] < 0.4 and doc["host_bytes_per_rank"] == 8 << 30
    assert cli.main(["plan", "--model", _good(tmp_path / "m.safetensors"), "--nodes", "2", "--mode", "p2p"]) == 0
    out = capsys.readouterr().out
    assert "p2p update" in out and "bottleneck" in out and "memory per rank" in out


def test_the_console_script_is_declared():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'ckpt-engine = "ckpt_core.cli:main"' in text


def test_bench_runs_the_benchmark_under_torchrun_and_passes_its_flags_and_exit_code(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "bench", "--nproc", "1", "--device", "cpu",
                           "--scale", "0.002", "--cases", "tiny", "--repeats", "1", "--host-touch-gib", "0.05",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [c["case"] for c in json.loads(out.read_text())["cases"]] == ["tiny"]
    bad = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "bench", "--nproc", "1", "--cases", "nonsense"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT))
    assert bad.returncode != 0
