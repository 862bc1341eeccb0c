"""FAKE ``torch_npu.multiprocessing`` (see ``torch_npu`` in this folder)."""
