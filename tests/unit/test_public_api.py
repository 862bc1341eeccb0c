"""The names users import from checkpoint-engine keep working; the exported surface is pinned."""

import inspect

import ckpt_core


def test_exported_names_are_pinned():
    assert sorted(ckpt_core.__all__) == sorted([
        "ParameterServer", "update_weights_from_ipc", "request_inference_to_update", "split_checkpoint_files",
        "local_device_key", "CkptError", "ConfigError", "CheckpointFormatError", "CheckpointNotFoundError",
        "TransportError", "UpdateTimeoutError", "ProtocolError", "RemoteWorkerError", "ClosedError", "__version__",
        "TensorShard", "DeltaBaseError", "DeviceResidentError",
    ])


def test_parameter_server_keeps_the_reference_signatures():
    ps = ckpt_core.ParameterServer
    init = inspect.signature(ps.__init__).parameters
    for name in ("rank", "world_size", "device", "auto_pg", "mem_fraction", "master_addr", "master_port"):
        assert name in init
    assert list(inspect.signature(ps.update).parameters)[:3] == ["self", "checkpoint_name", "req_func"]
    assert {"ranks", "timeout"} <= set(inspect.signature(ps.update).parameters)
    reg = inspect.signature(ps.register_checkpoint).parameters
    assert {"files", "named_tensors", "use_shared_memory_pool", "use_inplace_pin_memory"} <= set(reg)
    for method in ("unregister_checkpoint", "gather_metas", "get_metas", "load_metas", "device_uuid"):
        assert hasattr(ps, method) or method == "device_uuid"


def test_engine_side_entry_point_signature():
    params = inspect.signature(ckpt_core.update_weights_from_ipc).parameters
    assert list(params)[:3] == ["zmq_ctx", "zmq_handle", "device_id"]
    assert params["run"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["post_hook"].default is None


def test_every_error_is_a_ckpt_error():
    for name in ("ConfigError", "CheckpointFormatError", "CheckpointNotFoundError", "TransportError",
                 "UpdateTimeoutError", "ProtocolError", "RemoteWorkerError", "ClosedError", "DeltaBaseError",
                 "DeviceResidentError"):
        assert issubclass(getattr(ckpt_core, name), ckpt_core.CkptError)


def test_the_names_drivers_and_examples_import_are_pinned():
    """The examples import only these (tests/unit/test_examples_help.py): a package's ``__all__`` is its
    public surface, the modules inside are not."""
    import ckpt_core.client
    import ckpt_core.engines
    import ckpt_core.planning
    import ckpt_sglang
    import ckpt_vllm
    assert sorted(ckpt_core.engines.__all__) == sorted([
        "group_handles", "UPDATE_METHODS", "update_methods", "serves_p2p", "prepare_checkpoint", "run_updates",
        "slices_wanted", "emit_json_line", "number", "count", "SECONDS", "TIMEOUT", "GIB_OR_NONE", "MAX_DEVICES",
        "MAX_RANKS", "EngineKind", "EngineClient", "UpdateReport", "Requester", "get_engine", "available_engines",
        "register_engine"])
    assert sorted(ckpt_core.planning.__all__) == ["SlicePlan", "read_plan_file", "write_plan_file"]
    assert ckpt_core.client.__all__ == ["ServiceWorld", "env_token"]
    assert sorted(ckpt_vllm.__all__) == ["UpdateReport", "VllmClient", "VllmColocateWorkerExtension"]
    assert sorted(ckpt_sglang.__all__) == ["BUSY_MODES", "COMMIT_PAUSE_MODES", "PAUSE_MODES", "SglangClient",
                                           "UpdateReport"]
    for module in (ckpt_core.engines, ckpt_core.planning):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"
    assert ckpt_vllm.UpdateReport is ckpt_sglang.UpdateReport is ckpt_core.engines.UpdateReport, "one report"
