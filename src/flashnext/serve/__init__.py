"""Serving policy for a sidecar's rows, without vLLM: which sidecar a layer reads, whether its
geometry matches, where its rows are placed, and the device cache in front of them.

The vLLM plugin (:mod:`flashnext.integrations.vllm`), ``flashnext plan`` and ``flashnext check``
share it; it imports :mod:`flashnext.kernels` (only when rows are opened) and the sidecar
packages below, never vLLM.
"""
