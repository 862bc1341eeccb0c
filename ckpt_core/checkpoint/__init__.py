"""Checkpoint sources: our safetensors reader, host memory regions and pinning, duplicates, registration."""
