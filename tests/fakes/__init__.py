"""Hand-written fakes for hardware we do not have (see each module). Never on sys.path by default:
tests that want ``import torch_npu`` to find the fake put this folder on the path explicitly."""
