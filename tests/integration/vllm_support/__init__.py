"""Helpers of the real-vLLM integration tests: tiny model builder, HF reference, server fixture."""
