"""Shared test helpers, one home each (like Liger-Kernel's ``test/utils.py``):

- ``config``: the config tests' LMCache YAML, config files and problem assertions;
- ``kv``: random paged caches, slot lists and chunk assertions for the kernel tests;
- ``samples``: the codec's sample KV (synthetic, a torch transformer, a real Llama pass);
- ``tiers``: chunk buffers and keys for the tier tests;
- ``redis_server`` / ``s3_server``: real redis-server and moto S3 processes;
- ``models`` / ``engines``: tiny local Llama checkpoints and real vLLM engines.

Test modules, benchmarks and the scripts the engine tests run import them as
``support.<module>`` (``tests/`` is on ``sys.path``).
"""
