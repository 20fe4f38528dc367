"""Stand-in for vLLM's compiled ``vllm.vllm_flash_attn._vllm_fa2_C`` (devtools/vllm_gpu_carry.py).

The real FlashAttention-2 extension is 308 MB (the 64 MiB a device call may carry cannot hold
it). vllm/vllm_flash_attn/__init__.py raises ImportError unless FA2 or FA3 imports, and the PLE
layers' import path reaches it (mm_encoder_attention -> fa_utils). The PLE layers never run
attention; this module registers no kernel, so ``torch.ops._vllm_fa2_C.*`` stays undefined and
any attention call fails loudly. Drop this file where vLLM's own wheel is installed.
"""
