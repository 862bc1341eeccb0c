"""The names users import from checkpoint-engine keep working; the exported surface is pinned."""

import inspect

import ckpt_core


def test_exported_names_are_pinned():
    assert sorted(ckpt_core.__all__) == sorted([
        "ParameterServer", "update_weights_from_ipc", "request_inference_to_update", "split_checkpoint_files",
        "local_device_key", "CkptError", "ConfigError", "CheckpointFormatError", "CheckpointNotFoundError",
        "TransportError", "UpdateTimeoutError", "ProtocolError", "RemoteWorkerError", "ClosedError", "__version__",
        "TensorShard",
    ])


def test_parameter_server_keeps_the_reference_signatures():
    ps = ckpt_core.ParameterServer
    init = inspect.signature(ps.__init__).parameters
    for name in ("rank", "world_size", "device", "auto_pg", "mem_fraction", "master_addr", "master_port"):
        assert name in init
    assert list(inspect.signature(ps.update).parameters)[:3] == ["self", "name", "req_func"]
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
                 "UpdateTimeoutError", "ProtocolError", "RemoteWorkerError", "ClosedError"):
        assert issubclass(getattr(ckpt_core, name), ckpt_core.CkptError)
