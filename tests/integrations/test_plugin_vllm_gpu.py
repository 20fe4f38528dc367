"""The plugin's layers inside vLLM's real classes on a CUDA GPU, bit for bit against vLLM's own.

vLLM's ``Qwen4ExpNGramEmbedding`` is built under a world-of-one process group, as vLLM builds it
under its target device: once with the plugin off (vLLM's ``Qwen4ExpPLEPinnedHostEmbedding``,
the checkpoint's bf16 rows in pinned host memory, its Triton UVA gather), then with a bf16
sidecar of the same rows switched on through ``--additional-config`` for every placement
(``auto``, ``pinned``, ``staged``, ``device``), as ``SidecarPinnedEmbedding`` (the real
``start_prefetch`` on vLLM's side stream, ``_buffer``, ``finalize_prefetch``) and as
``SidecarDeviceEmbedding`` (``forward``). Every output must equal vLLM's bit for bit, and vLLM's
must equal the table's rows at the ids ``flashnext.ple.hashing`` computes (an independent
reference for both). Steps of changing sizes reuse the prefetch buffer; work on the main stream
runs between ``start_prefetch`` and ``finalize_prefetch``, as the previous decoder layer would.

On vLLM 0.34 (``--engram-config '{"disk_offload": true}'``) vLLM's own
``Qwen4ExpPLEDiskOffloadEmbedding`` is built too, fed the checkpoint's shards as vLLM's loader
feeds it (memory-mapped views from ``safe_open`` of a real safetensors file, then
``process_weights_after_loading`` binds the files), and each step staged by vLLM's
``stage_checkpoint_rows``: its rows must equal vLLM's pinned layer's and the sidecar layers'
bit for bit, also when the checkpoint ships the whole table as ``shard_.weight`` (the plugin's
loader fix).

Needs vLLM (a release's Python tree: ``devtools/vllm_gpu_carry.py --vllm V`` packs it for a GPU
machine without vLLM) and a CUDA GPU; skips with the reason otherwise.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids_packed
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows, flash_next_config

torch = pytest.importorskip("torch", reason="torch not installed: pip install 'flashnext[gpu]'")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (vLLM's pinned layer gathers over UVA)", allow_module_level=True)
pytest.importorskip("vllm", reason="vLLM not installed: pip install 'flashnext[vllm]'")

from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.distributed.parallel_state import (  # noqa: E402
    destroy_distributed_environment,
    destroy_model_parallel,
)
from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding  # noqa: E402

from devtools.vllm_cpu import free_port  # noqa: E402
from flashnext.integrations.vllm import apply_parts  # noqa: E402
from flashnext.integrations.vllm.settings import PluginSettings  # noqa: E402

CONFIG = flash_next_config(ngram_vocab_size_base=20_000, ple_layer_ids=[1])
PREFIX = "model.layers.0.ple.ple_embedding"
MAX_TOKENS = 4096
PLACEMENTS = ("auto", "pinned", "staged", "device")
STEPS = (8, 1000, 1, 4096, 33)  # decode, prefill, one token, the whole buffer, odd


def test_every_part_checks_on_this_vllm():
    """Each part's check (the seams it patches: imports, classes, signatures) holds on the vLLM
    this process imports, the B12x guard's included (no B12x kernel runs here)."""
    import importlib

    from flashnext.integrations.vllm import PART_MODULES

    for name in PART_MODULES.values():
        importlib.import_module(name).check()


@pytest.fixture(scope="module")
def world():
    """vLLM's process groups for a world of one (ETP = TP = DP = 1)."""
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="module")
def geometry() -> PLEGeometry:
    return PLEGeometry.from_config(CONFIG)


@pytest.fixture(scope="module")
def table(geometry, tmp_path_factory):
    """(bf16 rows as vLLM loads them [rows, width], the bf16 sidecar of the same rows)."""
    from tests.seeding import seeded_rng

    rows = embedding_rows(geometry.num_rows, geometry.width, seeded_rng("plugin_vllm_gpu"))
    bf16 = torch.from_numpy(rows).to(torch.bfloat16)
    rows = bf16.float().numpy()  # bf16 values: the sidecar stores them exactly
    sidecar = write_sidecar(
        tmp_path_factory.mktemp("sidecar") / "bf16",
        "bf16",
        rows,
        geometry.shard_rows(),
        geometry=geometry.to_dict(),
    )
    return bf16, sidecar


def _text_config():
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**CONFIG)


#: vLLM 0.34's ``--engram-config`` key for its disk-offload layer (absent before 0.34).
HAS_DISK_OFFLOAD = hasattr(EngramConfig(), "disk_offload")


def _build(
    cpu_offload: bool, additional: dict | None, disk_offload: bool = False
) -> Qwen4ExpNGramEmbedding:
    """vLLM's PLE embedding module, built as the model builds it (current config, CUDA device)."""
    config = VllmConfig()
    engram = {"disk_offload": True} if disk_offload else {}
    config.engram_config = EngramConfig(cpu_offload=cpu_offload, **engram)
    config.additional_config = additional or {}
    with set_current_vllm_config(config), torch.device("cuda"):
        return Qwen4ExpNGramEmbedding(
            _text_config(),
            CONFIG["ple_embed_dim"],
            0,
            MAX_TOKENS,
            data_parallel_rank=0,
            prefix=PREFIX,
            params_dtype=torch.bfloat16,
        )


def _checkpoint(rows: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    parts = CONFIG["split_ngram_parts"]
    size = -(-rows.shape[0] // parts)
    return [
        (f"ngram_embedding.shard_{k}.weight", rows[k * size : (k + 1) * size]) for k in range(parts)
    ]


def _batch(rng: np.random.Generator, tokens: int) -> dict[str, np.ndarray]:
    """A packed batch of up to 3 requests (one continues a chunked prompt), EOS inside."""
    toks = rng.integers(0, CONFIG["vocab_size"], size=tokens)
    toks[rng.integers(0, tokens)] = CONFIG["eos_token_id"]
    cuts = np.sort(rng.integers(0, tokens + 1, size=2))
    qsl = np.array([0, *cuts, tokens], dtype=np.int64)
    ctx = np.full((3, 2), CONFIG["eos_token_id"], dtype=np.int64)
    ctx[1] = rng.integers(0, CONFIG["vocab_size"], size=2)
    return {"tokens": toks, "qsl": qsl, "ctx": ctx}


def _step(layer: Qwen4ExpNGramEmbedding, batch: dict[str, np.ndarray]) -> torch.Tensor:
    """One PLE lookup as vLLM's model runs it; returns bf16 ``[T, heads * width]`` on the host."""
    ids = torch.from_numpy(batch["tokens"]).cuda()
    qsl = torch.from_numpy(batch["qsl"]).to(torch.int32).cuda()
    ctx = torch.from_numpy(batch["ctx"]).cuda()
    from tests.seeding import current_test_rng

    gen = torch.Generator(device="cuda").manual_seed(int(current_test_rng("step").integers(1 << 31)))
    hidden = torch.randn(ids.shape[0], 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    if hasattr(layer.ngram_embedding, "stage_rows"):  # vLLM 0.34's disk offload
        from vllm.models.qwen4_exp.nvidia.ngram_embedding import stage_checkpoint_rows

        # what prepare_inputs (nvidia/model_state.py) does before the forward
        stage_checkpoint_rows([(layer, layer.ngram_embedding)], ids, qsl, ctx)
    layer.start_prefetch(ids, qsl, ctx)  # no-op for the device and disk-offload classes
    busy = torch.randn(2048, 2048, device="cuda", generator=gen)
    for _ in range(4):  # the previous decoder layer, on the main stream
        busy = busy @ busy / 2048
    out = layer(hidden, ids, qsl, ctx)
    out = layer.ngram_embedding.dequantize(out, torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.isfinite(busy).all()
    return out.cpu()


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


@pytest.fixture(scope="module")
def vllm_pinned(world, table):
    """vLLM's own pinned layer (plugin off), loaded from the checkpoint's bf16 rows."""
    layer = _build(True, None)
    emb = layer.ngram_embedding
    assert type(emb).__name__ == "Qwen4ExpPLEPinnedHostEmbedding"
    assert type(emb).__module__.startswith("vllm."), "the plugin replaced vLLM's layer while off"
    layer.load_weights(_checkpoint(table[0]))
    assert emb.weight.is_pinned()
    return layer


def test_vllm_pinned_layer_reads_the_rows_flashnext_hashes(vllm_pinned, table, geometry, rng):
    rows = table[0]
    for tokens in (8, 1000):
        batch = _batch(rng, tokens)
        got = _step(vllm_pinned, batch)
        ids = ngram_ids_packed(geometry, batch["tokens"], batch["qsl"], batch["ctx"])
        want = rows[torch.from_numpy(ids).reshape(-1)].reshape(tokens, -1)
        assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("cpu_offload", [True, False], ids=["pinned_class", "device_class"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_sidecar_layer_equals_vllm_pinned_layer(
    vllm_pinned, table, placement, cpu_offload, rng, caplog
):
    """The sidecar layers, every placement, bit for bit against vLLM's own pinned layer."""
    apply_parts(("ple_sidecar",), PluginSettings())  # what register() does in every process
    additional = {"flashnext": {"ple_sidecar": str(table[1].path), "ple_placement": placement}}
    with caplog.at_level(logging.INFO, logger="flashnext.integrations.vllm"):
        layer = _build(cpu_offload, additional)
    emb = layer.ngram_embedding
    want_class = "SidecarPinnedEmbedding" if cpu_offload else "SidecarDeviceEmbedding"
    assert type(emb).__name__ == want_class
    assert emb.weight.numel() == 0  # no table in the layer: the sidecar serves the rows
    chosen = emb._rows.choice.placement
    expected = "pinned" if placement == "auto" else placement  # the H200 host holds the table
    assert chosen == expected, emb._rows.choice.reason
    line = [r.getMessage() for r in caplog.records if PREFIX in r.getMessage()]
    assert line and f"{chosen}: " in line[-1], line
    layer.load_weights(_checkpoint(table[0]))  # taken and dropped, as from a checkpoint
    for tokens in STEPS:
        batch = _batch(rng, tokens)
        ours, theirs = _step(layer, batch), _step(vllm_pinned, batch)
        assert ours.dtype == theirs.dtype == torch.bfloat16
        assert np.array_equal(_bits(ours), _bits(theirs)), f"T={tokens}"
    if cpu_offload:
        buffer = emb._prefetch_buffer
        assert buffer is not None and buffer.shape == (MAX_TOKENS, emb._output_dim)
        assert emb._buffer(buffer.device) is buffer  # allocated once, reused by every step


# -- the hot-row device cache switches (FLASHNEXT_PLE_DEVICE_CACHE / FLASHNEXT_PLE_PROFILE) -------------
@pytest.fixture(scope="module")
def profiled(table, geometry, tmp_path_factory):
    """(a real hot-row profile file of the sidecar's table, the token documents it counted)."""
    from flashnext.store.profile import build_profile, write_profile
    from tests.seeding import seeded_rng

    gen = seeded_rng("plugin_vllm_gpu_profile")
    docs = [gen.integers(0, CONFIG["vocab_size"], size=int(gen.integers(100, 300)))
            for _ in range(12)]  # fmt: skip
    path = tmp_path_factory.mktemp("profile") / "profile.safetensors"
    return write_profile(path, build_profile(geometry, docs)), docs


def _mixed_batch(rng: np.random.Generator, docs: list, tokens: int) -> dict[str, np.ndarray]:
    """Two fresh requests: the first starts like a profiled document (cache hits), the second
    is random tokens (mostly misses)."""
    half = max(1, tokens // 2)
    toks = rng.integers(0, CONFIG["vocab_size"], size=tokens)
    doc = docs[int(rng.integers(len(docs)))][:half]
    toks[: doc.size] = doc
    qsl = np.array([0, half, tokens] if tokens > half else [0, tokens], dtype=np.int64)
    ctx = np.full((qsl.size - 1, 2), CONFIG["eos_token_id"], dtype=np.int64)
    return {"tokens": toks, "qsl": qsl, "ctx": ctx}


@pytest.mark.parametrize("placement", ["pinned", "staged"])
def test_cache_switches_serve_the_same_rows(vllm_pinned, table, geometry, profiled, placement,
                                            rng, caplog):  # fmt: skip
    """FLASHNEXT_PLE_DEVICE_CACHE=64MiB with a profile in front of pinned and staged rows: the start
    line names the cache, the profile and its expected hit rate, and every step (hits and
    misses together) equals the same layer without the cache, and vLLM's, bit for bit."""
    from flashnext.ple.hashing import ngram_ids_packed as hashed

    profile_file, docs = profiled
    apply_parts(("ple_sidecar",), PluginSettings())
    plain_cfg = {"ple_sidecar": str(table[1].path), "ple_placement": placement}
    cached_cfg = {**plain_cfg, "ple_device_cache": "64MiB", "ple_profile": str(profile_file)}
    plain = _build(True, {"flashnext": plain_cfg})
    with caplog.at_level(logging.INFO, logger="flashnext.integrations.vllm"):
        cached = _build(True, {"flashnext": cached_cfg})
    rows = cached.ngram_embedding._rows
    plan = rows.cache
    assert rows.choice.placement == placement and plan.rows > 0, plan.reason
    line = [r.getMessage() for r in caplog.records if PREFIX in r.getMessage()][-1]
    rate = f"expected hit rate {100 * plan.expected_hit_rate:.1f}%"
    size = f"device cache {64 / 1024:.2f} GiB"  # 64 MiB, as CachePlan.describe spells it
    for phrase in (f"{placement}: ", size, f"{plan.rows} rows from", f"from {profile_file}", rate):
        assert phrase in line, (phrase, line)
    target = rows._staged if placement == "staged" else rows._gpu
    assert target.cache_info.rows == plan.rows
    slot_map = target.slot_map if placement == "staged" else target._slot_map.cpu().numpy()
    start = cached.ngram_embedding.shard_indices.org_vocab_start_index
    for layer in (plain, cached):
        layer.load_weights(_checkpoint(table[0]))
    mixed = 0
    for tokens in (8, 1000, 333, 1):
        batch = _mixed_batch(rng, docs, tokens)
        ids = hashed(geometry, batch["tokens"], batch["qsl"], batch["ctx"]).reshape(-1)
        hit = slot_map[ids - start] >= 0
        mixed += bool(hit.any() and not hit.all())
        ours, without, theirs = (_step(x, batch) for x in (cached, plain, vllm_pinned))
        assert np.array_equal(_bits(ours), _bits(without)), f"T={tokens}"
        assert np.array_equal(_bits(ours), _bits(theirs)), f"T={tokens}"
    assert mixed >= 3  # hits and misses in one step (T=1 may be all hits)


# -- vLLM 0.34's disk offload (Qwen4ExpPLEDiskOffloadEmbedding) on the same rows ------------------
needs_disk_offload = pytest.mark.skipif(
    not HAS_DISK_OFFLOAD, reason="vLLM before 0.34 has no disk_offload in --engram-config"
)


def _safetensors_checkpoint(path, tensors: list[tuple[str, torch.Tensor]]):
    """Write ``tensors`` to a safetensors file and read them back as vLLM's loader does
    (``safe_open(..., "pt").get_tensor``: views of a private map of the file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors}, str(path))
    with safe_open(str(path), "pt") as f:
        return [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118


def _vllm_disk_offload(weights: list[tuple[str, torch.Tensor]]) -> Qwen4ExpNGramEmbedding:
    """vLLM's own disk-offload layer (plugin off), loaded and bound as vLLM's loader does."""
    layer = _build(True, None, disk_offload=True)
    emb = layer.ngram_embedding
    assert type(emb).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
    assert type(emb).__module__.startswith("vllm.")
    layer.load_weights(weights)
    emb.embedding_method.process_weights_after_loading(emb)  # bind_file_shards
    assert emb.weight.numel() == 0 and emb._fds  # no table: file descriptors of the shards
    return layer


@pytest.fixture(scope="module")
def vllm_disk(world, table, tmp_path_factory):
    """vLLM 0.34's disk-offload layer over the checkpoint's numbered bf16 shards on disk."""
    path = tmp_path_factory.mktemp("checkpoint") / "numbered.safetensors"
    return _vllm_disk_offload(_safetensors_checkpoint(path, _checkpoint(table[0])))


@needs_disk_offload
def test_vllm_disk_offload_layer_equals_vllm_pinned_layer(vllm_disk, vllm_pinned, table,
                                                          geometry, rng):  # fmt: skip
    """vLLM's two layers (pinned table, rows read from the checkpoint files each step) serve the
    same bits, and those are the table's rows at the ids flashnext hashes."""
    for tokens in STEPS:
        batch = _batch(rng, tokens)
        disk, pinned = _step(vllm_disk, batch), _step(vllm_pinned, batch)
        assert np.array_equal(_bits(disk), _bits(pinned)), f"T={tokens}"
        ids = ngram_ids_packed(geometry, batch["tokens"], batch["qsl"], batch["ctx"])
        want = table[0][torch.from_numpy(ids).reshape(-1)].reshape(tokens, -1)
        assert np.array_equal(_bits(disk), _bits(want)), f"T={tokens}"


@needs_disk_offload
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_sidecar_layer_equals_vllm_disk_offload_layer(vllm_disk, table, placement, rng):
    """Every placement of the sidecar layer, bit for bit against vLLM's disk-offload layer."""
    apply_parts(("ple_sidecar",), PluginSettings())
    additional = {"flashnext": {"ple_sidecar": str(table[1].path), "ple_placement": placement}}
    layer = _build(True, additional)
    assert type(layer.ngram_embedding).__name__ == "SidecarPinnedEmbedding"
    for tokens in STEPS:
        batch = _batch(rng, tokens)
        ours, theirs = _step(layer, batch), _step(vllm_disk, batch)
        assert np.array_equal(_bits(ours), _bits(theirs)), f"T={tokens}"


@needs_disk_offload
def test_loader_fix_gives_disk_offload_the_whole_table(world, vllm_pinned, table, rng,
                                                       tmp_path):  # fmt: skip
    """A checkpoint with the whole table under ``shard_.weight``, which vLLM 0.34's disk
    offload hands to its regular loader (and fails): with the plugin's loader fix the layer
    reads that tensor's file, and serves vLLM's pinned layer's bits."""
    apply_parts(("ple_loader_fix",), PluginSettings())
    weights = [("ngram_embedding.shard_.weight", table[0])]
    layer = _vllm_disk_offload(_safetensors_checkpoint(tmp_path / "whole.safetensors", weights))
    assert len(layer.ngram_embedding._fds) == 1
    for tokens in (8, 1000, 1):
        batch = _batch(rng, tokens)
        ours, theirs = _step(layer, batch), _step(vllm_pinned, batch)
        assert np.array_equal(_bits(ours), _bits(theirs)), f"T={tokens}"


@needs_disk_offload
def test_sidecar_with_disk_offload_is_refused_by_the_layer(world, table):
    """``disk_offload`` reached the model by a way start-up cannot read (a config object, as
    ``LLM(engram_config=...)`` builds one) while the sidecar is on: vLLM's disk-offload layer,
    which the sidecar does not replace, refuses naming both switches instead of serving without
    the sidecar; with the sidecar off it is vLLM's own layer."""
    from flashnext.errors import PluginError

    apply_parts(("ple_sidecar",), PluginSettings())
    additional = {"flashnext": {"ple_sidecar": str(table[1].path)}}
    with pytest.raises(PluginError, match=r"FLASHNEXT_PLE_SIDECAR.*disk_offload=true"):
        _build(True, additional, disk_offload=True)
    emb = _build(True, None, disk_offload=True).ngram_embedding
    assert type(emb).__name__ == "Qwen4ExpPLEDiskOffloadEmbedding"
    assert type(emb).__module__.startswith("vllm.")
