"""ckpt-engine as a verl checkpoint engine (``ckpt_verl.backend``; docs/frameworks-verl.md).

verl loads it by name, no change to verl::

    actor_rollout_ref.rollout.checkpoint_engine.backend=ckpt
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ckpt_verl.backend

Importing this package imports neither verl nor the backend; ``ckpt_verl.backend`` needs verl.
"""

BACKEND_NAME = "ckpt"

__all__ = ["BACKEND_NAME"]
