"""Stand-in for vLLM's compiled ``vllm._C_stable_libtorch`` (copied in by devtools/vllm_gpu_carry.py).

The real extension (78 MB, 56 MB deflated: over what one device call may carry) registers vLLM's
``torch.ops._C`` kernels; vllm/platforms/cuda.py imports it unconditionally. The PLE layers and
their Triton kernels call none of those kernels. A few modules on the PLE layers' import path ask
at import time whether CUTLASS kernels exist for this GPU (``CUTLASS_BLOCK_FP8_SUPPORTED`` in
w8a8_utils.py); here every such query answers False (no CUTLASS kernel), which only steers
quantized linear layers, none of which the tests build. One kernel the pinned PLE layer does
call is ``get_cuda_view_from_cpu_tensor`` (its UVA view of the pinned table): here it is what
vLLM's csrc/cuda_view.cu does, spelled in Python (``cuMemHostGetDevicePointer`` of the pinned
tensor's address, the same sizes and strides, the CPU tensor kept alive). Any other
``torch.ops._C`` kernel stays undefined and fails loudly if called. Drop this file where vLLM's
own wheel is installed.
"""

import torch

#: Capability queries vLLM makes while importing modules the PLE layers import.
QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_group_gemm_supported",
)


def _unsupported(cuda_device_capability: int) -> bool:
    del cuda_device_capability
    return False


_lib = torch.library.Library("_C", "FRAGMENT")
for _name in QUERIES:
    _lib.define(f"{_name}(int cuda_device_capability) -> bool")
    _lib.impl(_name, _unsupported, "CompositeExplicitAutograd")


def _host_device_pointer(host_ptr: int) -> int:
    """The device address of pinned host memory (cuMemHostGetDevicePointer, from libcuda)."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemHostGetDevicePointer_v2
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out = ctypes.c_uint64()
    rc = fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed: CUDA error {rc}")
    return int(out.value)


class _DeviceBytes:
    """``nbytes`` device-visible bytes at ``ptr`` (CUDA array interface); keeps ``owner`` alive."""

    def __init__(self, ptr: int, nbytes: int, owner: torch.Tensor):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same (pinned) host bytes: same dtype, sizes and strides."""
    if cpu_tensor.device.type != "cpu" or not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs a pinned CPU tensor")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    ptr = _host_device_pointer(cpu_tensor.data_ptr())
    last = sum((n - 1) * st for n, st in zip(cpu_tensor.shape, cpu_tensor.stride()))
    nbytes = (last + 1) * cpu_tensor.element_size()
    raw = torch.as_tensor(_DeviceBytes(ptr, nbytes, cpu_tensor), device="cuda")
    return raw.view(cpu_tensor.dtype).as_strided(cpu_tensor.shape, cpu_tensor.stride())


_lib.define("get_cuda_view_from_cpu_tensor(Tensor(a!) cpu_tensor) -> Tensor")
_lib.impl("get_cuda_view_from_cpu_tensor", get_cuda_view_from_cpu_tensor, "CPU")
