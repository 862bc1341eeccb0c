"""`ckpt-engine` on plain bad input: a process of its own each (tests/cli_runner.py), the documented exit code, a message naming
the problem, and never a Python traceback. Also the surface around it: options after the subcommand,
--version, `bench --help`, the unit-named options and their deprecated aliases."""

import json
import os
import struct

import pytest
import torch
from support.cli_runner import run_cli

from ckpt_core import cli
from ckpt_core.checkpoint.safetensors import write_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*argv, cwd=None, timeout=120):
    return run_cli(*argv, cwd=cwd or ROOT, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("m") / "m.safetensors")
    write_file(path, {"w": torch.randn(64, 8, generator=torch.Generator().manual_seed(61))})
    return path


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A header of deeply nested JSON: RecursionError in json.loads unless translated."""
    body = b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    path = str(tmp_path_factory.mktemp("d") / "deep.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
    return path


USAGE = [   # argparse rejects these before any work: exit 2, naming the option
    (["inspect", "{model}", "--ranks", "0"], "--ranks"),
    (["inspect", "{model}", "--ranks", "-3"], "--ranks"),
    (["inspect", "{model}", "--device-mem-gib", "nan"], "--device-mem-gib"),
    (["inspect", "{model}", "--device-mem-gib", "-1"], "--device-mem-gib"),
    (["plan", "--size-gib", "nan", "--tensors", "10"], "--size-gib"),
    (["plan", "--size-gib", "inf", "--tensors", "10"], "--size-gib"),
    (["plan", "--size-gib", "1", "--tensors", "0"], "--tensors"),
    (["plan", "--size-gib", "1", "--tensors", "10", "--nic-gb-per-s", "inf"], "--nic-gb-per-s"),
    (["plan", "--size-gib", "1", "--tensors", "10", "--nodes", "0"], "--nodes"),
    (["plan", "--size-gib", "1", "--tensors", "10", "--slots", "two"], "--slots"),
    (["serve", "--max-bucket-gib", "nan"], "--max-bucket-gib"),
    (["serve", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["serve", "--port", "70000"], "--port"),
    (["inspect", "{model}", "--log-level", "LOUD"], "--log-level"),
]


@pytest.mark.parametrize("argv, needle", USAGE, ids=[" ".join(a[1:]) for a, _ in USAGE])
def test_a_bad_number_is_a_usage_error_naming_the_option_without_a_traceback(argv, needle, model):
    proc = run(*[a.format(model=model) for a in argv])
    assert proc.returncode == cli.EXIT_USAGE, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]


def test_a_socket_template_with_an_unknown_field_is_a_config_error_before_anything_starts(tmp_path):
    proc = run("serve", "--device", "cpu", "--uds", str(tmp_path / "{rnak}.sock"))
    assert proc.returncode == cli.EXIT_CONFIG, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "{rnak}" in proc.stderr and "{rank}" in proc.stderr
    assert os.listdir(tmp_path) == []
    proc = run("serve", "--device", "cpu", "--uds", str(tmp_path / "ps-{rank.sock"))
    assert proc.returncode == cli.EXIT_CONFIG and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_a_port_that_local_rank_1_would_push_past_65535_is_refused_before_anything_starts(option):
    proc = run_cli("serve", "--device", "cpu", "--host", "127.0.0.1", option, "65535", timeout=120,
                   env=dict(os.environ, PYTHONPATH=ROOT, LOCAL_RANK="1", RANK="1", WORLD_SIZE="2"))
    assert proc.returncode == cli.EXIT_CONFIG, proc.stderr[-2000:]
    assert f"{option} 65535" in proc.stderr and "65536" in proc.stderr and "Traceback" not in proc.stderr


def test_a_deeply_nested_header_is_a_format_error_exit_3(deep):
    proc = run("--json", "inspect", deep)
    assert proc.returncode == cli.EXIT_FORMAT, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    err = json.loads(proc.stdout)["error"]
    assert err["type"] == "CheckpointFormatError" and "nested" in err["message"] and deep in err["message"]


def test_json_and_log_level_work_after_the_subcommand_too(model):
    before, after = run("--json", "inspect", model), run("inspect", model, "--json", "--log-level", "debug")
    assert before.returncode == after.returncode == 0, after.stderr[-2000:]
    assert json.loads(before.stdout) == json.loads(after.stdout)
    bad = run("inspect", "/no/such/file", "--json")
    assert bad.returncode == cli.EXIT_CONFIG and json.loads(bad.stdout)["error"]["type"] == "ConfigError"


def test_version_prints_the_package_version():
    proc = run("--version")
    assert proc.returncode == 0
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert proc.stdout.strip() == f"ckpt-engine {version}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["serve", "--help"], ["inspect", "--help"],
                                  ["plan", "--help"]], ids=" ".join)
def test_help_and_version_do_not_import_torch(argv, tmp_path):
    """A fresh interpreter whose torch cannot be imported (a package of that name that raises comes
    first on the path): --help and --version still answer, so they never pay torch's seconds."""
    import subprocess
    import sys
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('ckpt-engine imported torch')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    proc = subprocess.run([sys.executable, "-m", "ckpt_core.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "usage: ckpt-engine" in proc.stdout or proc.stdout.startswith("ckpt-engine "), proc.stdout[:500]


def test_bench_help_lists_the_benchmarks_own_flags():
    proc = run("bench", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--nproc", "--cases", "--scale", "--repeats", "--out"):
        assert flag in proc.stdout, flag


def test_the_old_gbps_option_names_still_work_warn_and_mean_the_same_gigabytes(capsys):
    base = ["--json", "plan", "--size-gib", "64", "--tensors", "500", "--nodes", "2", "--devices", "8"]
    assert cli.main(base + ["--nic-gb-per-s", "12.5"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--nic-gbps", "12.5"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["update_s"] == new["update_s"] and new["topology"]["nic_gbps"] == 12.5
    assert "--nic-gbps is deprecated" in out.err and "GB/s" in out.err and "--nic-gb-per-s" in out.err
    assert cli.main(base + ["--nic-gb-per-s", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["update_s"] < new["update_s"], "the NIC rate is what it sets"


def test_serve_takes_the_bucket_bound_in_gib_under_both_names(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["serve", "--max-bucket-gib", "0.5"]).max_bucket_gib == 0.5
    assert parser.parse_args(["serve", "--max-bucket-gb", "0.5"]).max_bucket_gib == 0.5
    assert "--max-bucket-gb is deprecated" in capsys.readouterr().err
    assert parser.parse_args(["serve"]).max_bucket_gib is None


def test_the_exit_code_table_is_documented_as_the_code_has_it():
    doc = open(os.path.join(ROOT, "docs", "operations.md")).read()
    for code, meaning in cli.EXIT_TABLE:
        assert f"| {code} |" in doc, (code, meaning)
    assert cli.exit_code(KeyError("x")) == cli.EXIT_INTERNAL


@pytest.mark.parametrize("entry, needle", [("../outside.safetensors", "outside the checkpoint directory"),
                                           ("/etc/hostname", "outside the checkpoint directory"),
                                           ("m.safetensors", "not in the index's weight_map")])
def test_inspect_refuses_an_index_pointing_outside_or_disagreeing_with_its_shards(tmp_path, entry, needle):
    write_file(str(tmp_path / "outside.safetensors"), {"x": torch.randn(4)})
    d = tmp_path / "model"
    d.mkdir()
    write_file(str(d / "m.safetensors"), {"a": torch.randn(4), "b": torch.randn(2)})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": entry}}))
    proc = run("--json", "inspect", str(d))
    assert proc.returncode == cli.EXIT_FORMAT, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and needle in json.loads(proc.stdout)["error"]["message"]
