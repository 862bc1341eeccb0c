"""VllmClient.slice_plan keeps a plan its workers still hold (no vLLM needed: its RPCs stand in)."""


def test_a_client_reuses_the_plan_its_workers_still_hold_and_records_again_otherwise():
    """``VllmClient.slice_plan(reuse=plan)``: no recording, no install while every worker holds that plan
    of these tensors (asked by ``ckpt_holds_slice_plan``); else the recording runs as without it."""
    from ckpt_core.planning.slices import SliceKey, split_plan
    from ckpt_vllm import VllmClient

    plan = split_plan(SliceKey("m", "tp=2", "t"), {"w": ("F32", (4, 2), 4)}, 2, {"w": 0})
    asked = []

    def rpc(method, args=()):
        asked.append(method)
        if method == "ckpt_holds_slice_plan":
            return [True, held]
        raise RuntimeError("recording")   # stands for the recording path: not taken while the plan is held

    client = VllmClient("http://127.0.0.1:1")
    client.collective_rpc = rpc
    held = True
    assert client.slice_plan({"w": ("F32", (4, 2))}, reuse=plan) is plan and asked == ["ckpt_holds_slice_plan"]
    held = False   # one worker restarted: record again
    try:
        client.slice_plan({"w": ("F32", (4, 2))}, reuse=plan)
    except RuntimeError:
        pass
    assert asked[-2:] == ["ckpt_holds_slice_plan", "ckpt_slice_plan"]
    asked.clear()
    held = True   # other tensors: record again without asking
    try:
        client.slice_plan({"w": ("F32", (4, 4))}, reuse=plan)
    except RuntimeError:
        pass
    assert asked == ["ckpt_slice_plan"]
    client.close()
