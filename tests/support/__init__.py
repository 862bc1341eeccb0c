"""What the tests share: real multi-process worlds, simulated engines, data and assertions.

``tests/`` is on ``sys.path`` (pytest puts the folder of the rootdir's ``conftest.py`` there, and
the worlds' child processes inherit it), so a test imports ``from support.world import PsWorld``.
Nothing is imported here: a module that runs in another virtualenv (SGLang's engine process imports
``support.stock_cpu_device``) pulls in only what it names.

The harness, by concern:

- ``procs``: how the worlds start their child processes (``CTX``: a fork server that imported torch
  once), ``pythonpath``, ``collect_world`` and ``run_world`` (which starts a world again on another
  port when its rank 0 lost the store's), and what a process holds (memory, descriptors, /dev/shm).
- ``engine``: the engine side: ``SimEngine`` workers, the ``EngineFront`` that fans an update out to
  them like ``/collective_rpc``, and the req_funcs that post to it.
- ``world``: parameter-server worlds: ``run_ps_world`` (a script of steps), ``PsWorld`` (commands one
  at a time, ``call`` runs ``fn(ps, rank, *args)`` of a module named by string, e.g.
  ``"support.p2p_cases"``), ``FreshCheckpoints``.
- ``data``: fresh random tensors (never zeros) in every dtype, and the digests engines must hold.
- ``asserts``: every rank failed alike, healthy workers aborted and unchanged, the fault table.
- ``wire``: hand-built wire content (a pickle bomb, a hello with its plan inline).
- ``ports``: free ports for servers, and ``on_a_free_port``: a launch made again on another port
  when another process took the one it was given before it bound it; ``torchrun``: torchrun worlds
  launched so (``run_torchrun``, ``start_torchrun``); ``forked``: short Python runs forked from a helper that imported
  the heavy libraries once; ``cli_runner``: ``ckpt-engine`` runs; ``traffic``: a thread of requests
  back to back while a test updates.

Cases and worlds of one area, shared by the CPU and GPU tests or run inside PS processes:
``e2e_cases``, ``parity_cases``, ``ps_fault_cases``, ``p2p_cases``, ``exposure_cases``,
``inplace_cases``, ``boxcopy_cases``, ``plan_refusal_cases``, ``stock_abort_cases``, ``delta_world``,
``shards_world``, ``slices_world``, ``service_world`` (real ``ckpt-engine serve`` processes),
``trainer_ranks``, ``stock_workers`` and ``stock_cpu_device`` (the stock checkpoint-engine worker),
``readme_code`` (the README's quickstart) and ``reference_driver.py`` (a script written for the
reference checkpoint-engine, run by ``test_migration.py``).
"""
