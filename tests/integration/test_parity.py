"""Drop-in parity with checkpoint-engine on CPU: req_func on every rank (the reference's test shape),
duplicate tensor names, and the surface a migrating user touches."""

from __future__ import annotations

import logging

import pytest
import torch

import parity_cases as cases
from harness import fresh_tensor
from ckpt_core import CheckpointFormatError
from ckpt_core._checkpoint import build_checkpoint
from ckpt_core._safetensors import write_file
from ckpt_core.devices import get_backend


def test_every_ranks_req_func_feeds_its_own_worker_three_updates_then_a_worker_error_reaches_every_rank(tmp_path):
    cases.case_reference_scenario("cpu", 2, tmp_path)
