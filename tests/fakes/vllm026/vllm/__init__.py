"""A stand-in for vLLM 0.26's trainer-side weight-transfer API (tests/support/trainer_ranks.py puts this folder
first on a trainer process's path): only the shapes ckpt_vllm.trainer and ckpt_vllm.plugin meet there,
with 0.26's signatures as read from its wheel. No vLLM runs on the test machines at that release."""

__version__ = "0.26.0"
