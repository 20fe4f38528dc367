"""WorkspacePool: equal keys share buffer objects (one allocation), other keys do not."""

import dataclasses

import numpy as np
import pytest

from flashnext.moe import WorkspaceConflictError, WorkspaceKey, WorkspacePool, WorkspaceSizes

KEY = WorkspaceKey(
    num_experts=512,
    top_k=10,
    hidden_size=64,
    intermediate_size=32,
    max_tokens=128,
    local_experts=512,
    output_dtype="bfloat16",
    device="cpu",
    activation="silu",
    quant_mode="nvfp4",
    source_format="modelopt_fp4",
)
SIZES = WorkspaceSizes(static_bytes=4096, dynamic_bytes=1024)


class CountingNumpyAllocator:
    """Real numpy buffers; counts calls so the test sees one allocation per key."""

    def __init__(self):
        self.calls = 0

    def __call__(self, key, sizes):
        self.calls += 1
        dynamic = np.empty(sizes.dynamic_bytes, np.uint8) if sizes.dynamic_bytes else None
        out = np.empty((key.max_tokens, key.hidden_size), np.float32)
        return np.empty(sizes.static_bytes, np.uint8), dynamic, out


def test_same_key_shares_buffer_objects_and_allocates_once():
    alloc = CountingNumpyAllocator()
    pool = WorkspacePool(allocator=alloc)
    layers = [pool.get(KEY, SIZES) for _ in range(48)]
    assert alloc.calls == 1
    assert all(x.static is layers[0].static for x in layers)
    assert all(x.output is layers[0].output and x.dynamic is layers[0].dynamic for x in layers)
    per_set = 4096 + 1024 + 128 * 64 * 4
    assert pool.allocated_bytes == per_set
    assert pool.saved_bytes == 47 * per_set
    kwargs = layers[5].wrapper_kwargs()
    assert kwargs["shared_static_workspace"] is layers[0].static


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(WorkspaceKey) if f.name != "device"]
)
def test_any_key_field_change_gives_separate_buffers(field):
    alloc = CountingNumpyAllocator()
    pool = WorkspacePool(allocator=alloc)
    value = getattr(KEY, field)
    other = dataclasses.replace(
        KEY, **{field: value + 1 if isinstance(value, int) else value + "x"}
    )
    a, b = pool.get(KEY, SIZES), pool.get(other, SIZES)
    assert alloc.calls == 2 and a.static is not b.static and a.output is not b.output
    assert pool.saved_bytes == 0
    assert len(pool.report()["keys"]) == 2


def test_second_stream_is_refused():
    pool = WorkspacePool(allocator=CountingNumpyAllocator())
    pool.get(KEY, SIZES, stream="stream-A")
    with pytest.raises(WorkspaceConflictError, match=r"bound to stream 'stream-A'.*one stream"):
        pool.get(KEY, SIZES, stream="stream-B")


def test_same_key_other_sizes_is_refused():
    pool = WorkspacePool(allocator=CountingNumpyAllocator())
    pool.get(KEY, SIZES)
    with pytest.raises(WorkspaceConflictError, match="key misses a field"):
        pool.get(KEY, WorkspaceSizes(static_bytes=8192))


def test_torch_allocator_shapes():
    torch = pytest.importorskip("torch", reason="torch not installed: pip install 'flashnext[gpu]'")
    pool = WorkspacePool()
    ws = pool.get(KEY, SIZES)
    assert ws.output.dtype == torch.bfloat16 and tuple(ws.output.shape) == (128, 64)
    assert ws.static.numel() == 4096 and ws.dynamic.numel() == 1024
