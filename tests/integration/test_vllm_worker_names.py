"""vLLM refuses to start when an extension attribute collides with its worker's (no vLLM needed)."""

from ckpt_vllm import VllmColocateWorkerExtension

# Methods of vLLM's GPU/CPU worker in 0.32-0.33 that an extension is likely to reuse by mistake.
VLLM_WORKER_NAMES = {"update_weights", "start_weight_update", "finish_weight_update", "init_weight_transfer_engine",
                     "shutdown_weight_transfer_engine", "reload_weights", "sleep", "wake_up", "load_model",
                     "init_device", "shutdown", "get_model", "device", "model_runner", "rank", "local_rank"}


def test_the_extension_adds_its_public_methods_and_only_ckpt_prefixed_helpers():
    names = {n for n in dir(VllmColocateWorkerExtension) if not n.startswith("__")}
    assert names & VLLM_WORKER_NAMES == set()
    assert {n for n in names if not n.startswith("_ckpt_")} == {"update_weights_from_ipc", "ckpt_state_digests",
                                                                    "commit_staged_weights", "drop_staged_weights",
                                                                    "ckpt_weight_versions", "ckpt_stage_status",
                                                                    "ckpt_prepare_staged", "ckpt_slice_plan",
                                                                    "ckpt_use_slice_plan", "ckpt_holds_slice_plan"}
