"""A real SGLang server on a GPU: after every update, every parameter and buffer equals a cold load.

Per model (bf16 Qwen2, bf16 Qwen3-MoE, FP8 block 128x128 Qwen2; tiny, random, built here) a server
starts with dummy weights and ``--checkpoint-engine-wait-weights-before-ready``, and is updated by
every path of ours, alternating checkpoints A and B:

1. ``python -m ckpt_sglang.update`` (A): the server's first weights; /health turns 200 after it;
2. the references: B, then A through SGLang's own file loader (``/update_weights_from_disk``);
3. the stock-wire IPC update (``ParameterServer(wire="stock")`` + ``SglangClient``, SGLang's
   ``/update_weights_from_ipc``): B, A, B; then the direct update through our loader
   (``via="loader"``: the same stock wire into the ``load`` op of ``ckpt_sglang.staging.load``,
   SGLang's ``load_weights``, post-processing as SGLang's IPC route runs it on 0.5.17): A, B, A, B;
4. staged updates committed (``--custom-weight-loader ckpt_sglang.staging.load``): A staged wholly in
   device memory (the live model must not change while it is staged), committed; B staged half in
   device memory and half in pinned host memory, committed;
5. a true cold start on A (started in the background at step 1): equal to the reference of A.

Deltas (``test_qwen2_bf16_deltas_through_our_loader_equal_a_cold_load``, passed on one H100, 2026-12-07): A whole
with ``deltas=True`` through our loader, then B and C (an AdamW step on B) as deltas, each equal to
SGLang's own file loader's load of that version.

After each update the digests of every parameter and buffer, read in SGLang's scheduler by our
loader ``ckpt_sglang.probe`` (SHA-256 of the bytes), must equal the reference's, and greedy tokens
too. bf16 Qwen2 also joins the cold server by P2P (Mooncake) when Mooncake's CUDA build is there.
FP8 per tensor: SGLang's post-processing transposes and replaces each weight, so every path of ours
must refuse the update before anything is written (the server keeps its cold-loaded weights).

Needs CUDA and SGLang with checkpoint-engine importable (e.g. the recipe of
../shared/gpu_sglang: ``PYTHONPATH=/tmp/ssite:$PWD``); skipped without them, with the reason.
One model at a time: ``-k qwen2_bf16``, ``-k qwen3_moe``, ``-k fp8_block``, ``-k fp8_tensor``
(about 3 minutes each; the first server start also builds SGLang's KV-cache kernel, ~90 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]


def _requirements() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for module, why in (("sglang", "SGLang (e.g. 0.5.17 installed with --target /tmp/ssite, ../shared/gpu_sglang)"),
                        ("checkpoint_engine", "checkpoint-engine 0.4.2 in SGLang's environment (its IPC route "
                                              "imports checkpoint_engine.worker)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {why} importable")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """One case's servers at a time (a new case closes the previous one's)."""
    _requirements()
    from sglang_gpu_cases import Case

    live: dict = {}

    def get(name: str):
        if name not in live:
            for other in list(live):
                live.pop(other).close()
            live[name] = Case(name, tmp_path_factory.mktemp(name))
        return live[name]

    yield get
    for case in live.values():
        case.close()


def _updates_equal_a_cold_load(case) -> None:
    from ckpt_sglang import SglangClient
    from sglang_gpu_cases import figures, launcher, new_ps

    dummy = case.start_dummy()
    assert dummy.health() == 503, "a server waiting for its first weights must not report healthy"
    case.start_cold(0)   # in the background: a true cold start on A, checked last

    # 1. our launcher gives the waiting server its first weights
    t0 = time.monotonic()
    lines = figures(launcher("--checkpoint-path", str(case.ckpts[0]), "--inference-parallel-size", "1",
                             "--endpoint", dummy.url, "--device", "cuda", "--weight-version", "A-launcher",
                             "--timeout", "300", "--ready-timeout", "120"))
    case.record["launcher"] = {"wall_s": time.monotonic() - t0, "ps": lines[-1]["ps"]["seconds"],
                               "engine": lines[-1]["engine"][0]["seconds"]}
    # the first /health generates: on a fresh machine SGLang builds its KV-cache kernel then (~90 s)
    case.record["healthy_after_s"] = dummy.wait_healthy(300)
    launched = dummy.digests()

    # 2. the references: SGLang's own file loader, in the same server
    case.take_references()
    assert not case_differences(launched, case.refs[0]), "the launcher's update differs from a cold load of A"
    case.record["steps"].append({"step": "launcher, wait-weights-before-ready", "holds": "A"})

    size = case.ckpts[1].joinpath("model.safetensors").stat().st_size
    # buckets of a quarter of the checkpoint: every update spans several, through the PS's ring
    with new_ps(max_bucket_gb=size / 4 / 2**30) as ps, SglangClient(dummy.url, timeout=300) as client:
        for i in range(2):
            ps.register_checkpoint(f"ckpt-{i}", files=case.files(i))
            ps.gather_metas(f"ckpt-{i}")
        # the first weights went in (the launcher's IPC update): /health is 200, so auto takes our loader
        assert client.route() == "loader", "a server holding its first weights and our loader: auto is the loader"
        # 3. the stock-wire IPC update: B, A, B
        ipc = []
        for step, index in enumerate((1, 0, 1)):
            result = ps.update(f"ckpt-{index}", client.req_func(weight_version=f"ipc-{step}", via="ipc"),
                               timeout=300)
            assert client.last_report.path == "ipc"
            ipc.append({"ps_s": result["seconds"]["total"], "engine": client.last_report.seconds})
            case.check(dummy, index, f"IPC update {step + 1} ({'AB'[index]})")
        case.record["ipc"] = ipc
        case.record["sessions"] = client.server.sessions   # None/False: SGLang 0.5.17 has none
        # 3b. the direct update through our loader (its load op: the stock loop into load_weights): A, B, A, B
        # (ending on B, which the staged steps below expect live before they stage A)
        direct = []
        for step, index in enumerate((0, 1, 0, 1)):
            result = ps.update(f"ckpt-{index}", client.req_func(weight_version=f"loader-{step}", via="loader"),
                               timeout=300)
            assert client.last_report.path == "loader" and client.last_report.workers[0]["version"] == f"loader-{step}"
            direct.append({"ps_s": result["seconds"]["total"], "engine": client.last_report.seconds,
                           "load_s": client.last_report.workers[0]["seconds"]["load"]})
            case.check(dummy, index, f"direct load through our loader {step + 1} ({'AB'[index]})")
            assert client.model_info()["weight_version"] == f"loader-{step}"
            assert [w["live"] for w in client.weight_versions()] == [f"loader-{step}"]
        case.record["loader"] = direct
        # 4. staged, then committed: A wholly on the device, B half on the device, half in pinned host memory
        for index, device_bytes in ((0, 1 << 40), (1, size // 2)):
            ps.update(f"ckpt-{index}", client.req_func(stage=f"staged-{index}", stage_device_bytes=device_bytes),
                      timeout=300)
            case.check(dummy, 1 - index, f"staged {'AB'[index]} (not committed yet)")
            report = client.commit(f"staged-{index}", timeout=300)
            case.record.setdefault("commits", []).append({"paused_s": report.seconds["paused"],
                                                          "workers": report.workers})
            staged = report.workers[0]
            assert staged["device_bytes"] > 0 and (staged["host_bytes"] > 0) == (index == 1), staged
            case.check(dummy, index, f"staged {'AB'[index]}, committed")
            assert client.model_info()["weight_version"] == f"staged-{index}"

    # 5. the true cold start on A equals the reference taken through SGLang's file loader
    cold = case.wait_cold()
    case.check(cold, 0, "cold start on A (validates the reference)")


def case_differences(got: dict, ref: dict) -> list[str]:
    from _sglang_server import differences
    return differences(got, ref["digests"])


def test_qwen2_bf16_every_update_path_equals_a_cold_load(cases):
    _updates_equal_a_cold_load(cases("qwen2-bf16"))


def test_qwen2_bf16_p2p_into_a_joining_server_equals_a_cold_load(cases, tmp_path):
    """Owners (``--update-method all --save-metas-file --sleep-time``) feed the dummy server B by
    broadcast, then P2P (it held A: loaded from disk first); a joiner launcher (``--load-metas-file``)
    pulls B over Mooncake (TCP, host 127.0.0.2 to 127.0.0.3) into the cold server, which held A."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"P2P needs Mooncake's CUDA build (mooncake-transfer-engine-cuda13): {exc}")
    from sglang_gpu_cases import figures, launcher, start_launcher

    case = cases("qwen2-bf16")
    if not case.refs:   # run alone (-k p2p), or after the first test failed early: servers and references
        if case.dummy is None:
            case.start_dummy()
            case.start_cold(0)
        figures(launcher("--checkpoint-path", str(case.ckpts[0]), "--inference-parallel-size", "1",
                         "--endpoint", case.dummy.url, "--device", "cuda", "--timeout", "300"))
        case.take_references()
    cold = case.cold if case.record.get("cold_start_s") else case.wait_cold()
    case.check(cold, 0, "the joiner before it joins (A)", tokens=False)
    case.dummy.load_from_disk(case.ckpts[0])   # the owners' server holds A, so their update of B shows
    metas, out = tmp_path / "metas.json", tmp_path / "owners.out"
    owners = start_launcher("--checkpoint-path", str(case.ckpts[1]), "--endpoint", case.dummy.url,
                            "--inference-parallel-size", "1", "--device", "cuda", "--timeout", "300",
                            "--update-method", "all", "--save-metas-file", str(metas), "--sleep-time", "300",
                            "--checkpoint-name", "p2p-B", "--weight-version", "B-owners", out=out,
                            env={"PS_P2P_HOST": "127.0.0.2", "NCCL_IB_DISABLE": "1"})
    try:
        deadline = time.monotonic() + 240
        while len([x for x in out.read_text().splitlines() if x.startswith("{")]) < 2:
            assert owners.poll() is None, f"owners exited {owners.returncode}: {(tmp_path / 'owners.out.err').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "the owners' broadcast and P2P updates did not end within 240 s"
            time.sleep(0.5)
        owner_lines = [json.loads(x) for x in out.read_text().splitlines() if x.startswith("{")]
        assert [x["method"] for x in owner_lines] == ["broadcast", "p2p"]
        case.check(case.dummy, 1, "owners: broadcast then P2P (B)")
        t0 = time.monotonic()
        joined = figures(launcher("--load-metas-file", str(metas), "--checkpoint-name", "p2p-B", "--endpoint",
                                  cold.url, "--inference-parallel-size", "1", "--device", "cuda", "--timeout", "300",
                                  "--weight-version", "B-joined", env={"PS_P2P_HOST": "127.0.0.3",
                                                                       "NCCL_IB_DISABLE": "1"}))
        case.record["p2p_join"] = {"wall_s": time.monotonic() - t0, "ps": joined[-1]["ps"]}
        assert joined[-1]["method"] == "p2p"
        case.check(cold, 1, "joiner pulled B by P2P")
    finally:
        if owners.poll() is None:   # its own process group: the launcher, torchrun and the rank
            os.killpg(owners.pid, signal.SIGTERM)
            owners.wait(60)


def _adamw_step(src, dst_dir, like_dir, seed: int = 39):
    """Checkpoint C: one AdamW step (lr 1e-5, float32 masters of ``src``'s bf16 tensors, random gradients on
    layer 0's attention only: a frozen rest), snapshotted in bf16, as tests/integration/test_vllm_delta.py's
    versions are; a directory with ``like_dir``'s config."""
    import re
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    attention = re.compile(r"^model\.layers\.0\.self_attn\.[qkvo]_proj\.")
    master = {n: t.float().clone().requires_grad_(True) for n, t in load_file(str(src)).items()}
    opt = torch.optim.AdamW(list(master.values()), lr=1e-5)
    gen = torch.Generator().manual_seed(seed)
    for n, t in master.items():
        t.grad = torch.randn(t.shape, generator=gen) if attention.search(n) else None
    opt.step()
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(like_dir / "config.json", dst_dir / "config.json")
    save_file({n: t.detach().to(torch.bfloat16).contiguous() for n, t in master.items()},
              str(dst_dir / "model.safetensors"))
    return dst_dir


def test_qwen2_bf16_deltas_through_our_loader_equal_a_cold_load(cases, tmp_path):
    """A whole with ``deltas=True`` through our loader (passed on one H100, 2026-12-07),
    then B as a delta of A and C (an AdamW step on B's layer 0 attention) as a delta of B
    (``ps.update(..., delta=True)``, ``SglangClient.req_func(deltas=True, weight_version=...)``): after
    each, every parameter and buffer equals SGLang's own file loader's load of that version, and greedy
    tokens too. On a GPU the unquantized bf16 linears, embeddings and norms hold the checkpoint's bytes:
    every changed tensor is scattered, no layer reloaded (27 and 6 tensors on the H100 run)."""
    from _sglang_server import differences
    from ckpt_sglang import SglangClient
    from sglang_gpu_cases import MAX_NEW, figures, launcher, new_ps

    case = cases("qwen2-bf16")
    if not case.refs:   # run alone (-k deltas), or after the first test failed early: server and references
        if case.dummy is None:
            case.start_dummy()
            case.start_cold(0)
        figures(launcher("--checkpoint-path", str(case.ckpts[0]), "--inference-parallel-size", "1",
                         "--endpoint", case.dummy.url, "--device", "cuda", "--timeout", "300"))
        case.take_references()
    dummy = case.dummy
    c_dir = _adamw_step(case.ckpts[1] / "model.safetensors", tmp_path / "ckpt-C", case.ckpts[1])
    dummy.load_from_disk(c_dir)   # the reference of C, through SGLang's own file loader
    ref_c = {"digests": dummy.digests(), "tokens": dummy.generate(case.prompts, MAX_NEW)}
    assert differences(ref_c["digests"], case.refs[1]["digests"]), "C must differ from B"
    steps = []
    with new_ps() as ps, SglangClient(dummy.url, timeout=300) as client:
        for name, path, base in (("A", case.ckpts[0], None), ("B", case.ckpts[1], "A"), ("C", c_dir, "B")):
            ps.register_checkpoint(name, files=[str(path / "model.safetensors")], base=base)
            ps.gather_metas(name)
            result = ps.update(name, client.req_func(deltas=True, weight_version=name), timeout=300,
                               delta=base is not None)
            worker = client.last_report.workers[0]
            assert worker["path"] == ("delta" if base else "full") and worker["version"] == name, worker
            if base is not None:   # bf16 on a GPU: every changed tensor scattered in place, no layer reloaded
                fig = worker["delta"]
                assert fig["reloaded"] == 0 and fig["scattered"] == result["delta"]["changed_tensors"], fig
            if base is None:
                assert worker["map"]["refuse"] is None, worker["map"]
                case.check(dummy, 0, "full update of A with deltas kept, through our loader")
            elif name == "B":
                case.check(dummy, 1, "delta A -> B through our loader")
            else:
                differ = differences(dummy.digests(), ref_c["digests"])
                assert not differ, f"delta B -> C: {len(differ)} tensors differ from a cold load of C: {differ[:20]}"
                assert dummy.generate(case.prompts, MAX_NEW) == ref_c["tokens"], "delta B -> C: greedy tokens differ"
            steps.append({"version": name, "ps": {k: result.get(k) for k in ("seconds", "delta")},
                          "worker": worker, "engine": client.last_report.seconds})
    case.record["deltas"] = steps


def test_qwen3_moe_every_update_path_equals_a_cold_load(cases):
    _updates_equal_a_cold_load(cases("qwen3_moe-bf16"))


def test_qwen2_fp8_block_every_update_path_equals_a_cold_load(cases):
    _updates_equal_a_cold_load(cases("qwen2-fp8-block"))


def test_qwen2_fp8_tensor_is_refused_by_every_path_before_anything_is_written(cases):
    """FP8 per tensor: a server cold-started on A; the launcher, the IPC update, a direct load and a stage of B are
    each refused with ConfigError before anything is posted; the server still holds exactly A. Then,
    for the record (printed, not asserted), what SGLang itself does when A is pushed into it anyway."""
    from ckpt_core.errors import ConfigError
    from ckpt_sglang import SglangClient
    from sglang_gpu_cases import launcher, new_ps

    case = cases("qwen2-fp8-tensor")
    cold = case.start_cold(0)
    case.wait_cold()
    held, tokens = cold.digests(), cold.generate(case.prompts, 12)
    proc = launcher("--checkpoint-path", str(case.ckpts[1]), "--inference-parallel-size", "1", "--endpoint",
                    cold.url, "--device", "cuda", "--timeout", "300")
    assert proc.returncode != 0 and "ConfigError" in proc.stderr and "FP8 per tensor" in proc.stderr, \
        proc.stderr[-4000:]
    with new_ps() as ps, SglangClient(cold.url, timeout=300) as client:
        ps.register_checkpoint("B", files=case.files(1))
        ps.gather_metas("B")
        for how, req in (("IPC update", client.req_func(weight_version="never", via="ipc")),
                         ("direct load", client.req_func(weight_version="never", via="loader")),
                         ("stage", client.req_func(stage="never"))):
            with pytest.raises(ConfigError, match="FP8 per tensor"):
                ps.update("B", req, timeout=120)
            case.record["steps"].append({"step": f"{how} refused", "holds": "A"})
        assert not case_differences(cold.digests(), {"digests": held}), "a refused update changed the server"
        assert cold.generate(case.prompts, 12) == tokens
    case.record["unrefused_reload_of_the_same_checkpoint"] = _reload_anyway(case, cold, held)


def _reload_anyway(case, cold, held: dict) -> dict:
    """What the refusal prevents, for the record (printed, not asserted): SGLang's own IPC route
    asked to load A into a server that holds A, with no precheck in the way."""
    from ckpt_sglang import SglangClient
    from sglang_gpu_cases import new_ps

    out: dict = {}
    try:
        with new_ps() as ps, SglangClient(cold.url, timeout=300) as client:
            ps.register_checkpoint("A", files=case.files(0))
            ps.gather_metas("A")

            def post_anyway(handles):
                resp = client.http.request("POST", "/update_weights_from_ipc", json={"zmq_handles": dict(handles)},
                                            timeout=300)
                out.update(status=resp.status_code, answer=resp.text[:300])
            try:
                ps.update("A", post_anyway, timeout=120)
                out["ps"] = "ok"
            except Exception as exc:   # noqa: BLE001 - recorded
                out["ps"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        out["tensors_changed"] = len(case_differences(cold.digests(), {"digests": held}))
    except Exception as exc:   # noqa: BLE001 - recorded
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"SGLANG-FP8-TENSOR | without the refusal, reloading the checkpoint it holds: {out}", flush=True)
    return out
