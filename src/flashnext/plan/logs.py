"""Read a vLLM log: find the memory-relevant events, pull their numbers, say what to do.

Each :data:`PATTERNS` entry is one event kind with a regex over one log line; the numbers are
the regex's named groups converted to int/float (thousands separators dropped, MiB/GiB kept
in the field name). :func:`read_log` returns the events in log order; :func:`explain_log` adds,
per failure, the options in order of cost.

A log is user text of any size: every pattern's work is linear in the line. A regex is never
``search``-ed (each start position could rescan the rest of the line: quadratic, 68 s for a
200,000-letter run); it is ``match``-ed only where one of its literal ``anchors`` occurs, at
the first :data:`MAX_TRIES` occurrences of each, and the regexes have no nested unbounded
scans. Colour codes (ANSI escapes) are removed before anything is read.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flashnext.checkpoint.ple_tensors import EMPTY_SHARD, GLOBAL_SCALE
from flashnext.plan.model import PlanError
from flashnext.records import REDACTED, SECRET_NAME

_NUM = r"[\d,]+(?:\.\d+)?"


#: The longest "non-default args: {...}" read (vLLM's is a few hundred characters).
MAX_ARGS_CHARS = 1 << 16
#: Occurrences of each anchor a pattern is tried at (a real vLLM line holds one).
MAX_TRIES = 8
#: An ANSI escape (colours, cursor moves) as terminals and `vllm serve` under a TTY print them.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: The dotted-name run just before an anchor, read backwards (linear: matched, not searched).
_NAME_RUN = re.compile(r"[\w.]*")


@dataclass(frozen=True)
class Pattern:
    """One event kind: a regex matched where one of its literal ``anchors`` starts, and
    whether it is a failure. ``name_before``: the ``name`` group also takes the dotted name
    that ends at the anchor (``model.layers.3.`` before ``ngram_embedding...``)."""

    kind: str
    regex: re.Pattern[str]
    failure: bool
    summary: str
    anchors: tuple[str, ...]
    name_before: bool = False

    def match(self, line: str) -> dict[str, str] | None:
        """The named groups of this event in ``line``, or None; linear in ``len(line)``."""
        starts = []
        for anchor in self.anchors:
            at = line.find(anchor)
            for _ in range(MAX_TRIES):
                if at < 0:
                    break
                starts.append(at)
                at = line.find(anchor, at + 1)
        for at in sorted(starts):
            m = self.regex.match(line, at)
            if m is None:
                continue
            groups = m.groupdict()
            if self.name_before:
                run = _NAME_RUN.match(line[:at][::-1])
                groups["name"] = (run.group()[::-1] if run else "") + groups["name"]
            return groups
        return None


def _p(
    kind: str, regex: str, failure: bool, summary: str, *anchors: str, name_before: bool = False
) -> Pattern:
    return Pattern(kind, re.compile(regex), failure, summary, anchors, name_before)


PATTERNS: tuple[Pattern, ...] = (
    _p(
        "kv_capacity_error",
        r"To serve at least one request with the model's max seq len \((?P<max_model_len>\d+)\), "
        r"\((?P<needed_gib>" + _NUM + r") GiB KV cache is needed, which is larger than the "
        r"available KV cache memory \((?P<available_gib>" + _NUM + r") GiB\)\."
        r"(?: Based on the available memory, the estimated maximum model length is "
        r"(?P<estimated_max_model_len>\d+)\.)?",
        True,
        "the KV cache cannot hold one request at max_model_len",
        "To serve at least one request",
    ),
    _p(
        "mamba_blocks_error",
        r"max_num_seqs \((?P<max_num_seqs>\d+)\) exceeds available Mamba cache blocks "
        r"\((?P<num_blocks>\d+)\)",
        True,
        "more sequences than state blocks: FULL CUDA graph capture cannot proceed",
        "max_num_seqs (",
    ),
    _p(
        "no_kv_memory",
        r"No available memory for the cache blocks",
        True,
        "weights and profiled activations left nothing for the KV cache",
        "No available memory",
    ),
    _p(
        "cuda_oom",
        r"(?:CUDA out of memory|OutOfMemoryError)(?:(?!Tried to allocate ).)*"
        r"Tried to allocate (?P<requested>"
        + _NUM
        + r") (?P<requested_unit>[KMG]iB)(?:(?:(?!total capacity of ).)*total capacity of (?P<total>"
        + _NUM
        + r") (?P<total_unit>[KMG]iB) of which (?P<free>"
        + _NUM
        + r") (?P<free_unit>[KMG]iB) "
        r"is free)?",
        True,
        "a GPU allocation failed",
        "CUDA out of memory",
        "OutOfMemoryError",
    ),
    _p(
        "graph_capture_failed",
        r"(?:operation not permitted when stream is capturing|operation failed due to a "
        r"previous error during capture|cudaErrorStreamCapture\w+|CUDA graph capture failed)",
        True,
        "CUDA graph capture failed: an operation ran that a graph cannot hold",
        "operation not permitted when stream is capturing",
        "operation failed due to a previous error during capture",
        "cudaErrorStreamCapture",
        "CUDA graph capture failed",
    ),
    _p(
        "host_oom",
        r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (?P<bytes>\d+) bytes",
        True,
        "host RAM allocation refused (the kernel's overcommit heuristic or a commit limit)",
        "DefaultCPUAllocator: can't allocate memory",
    ),
    _p(
        "pidfd_getfd",
        r"pidfd_getfd(?:\(2\))?: Operation not permitted",
        True,
        "the PLE offload worker could not take the GPU worker's CUDA IPC file descriptor",
        "pidfd_getfd",
    ),
    _p(
        "ple_empty_shard_name",
        r"There is no module or parameter named '?(?P<name>[\w.]*?" + re.escape(EMPTY_SHARD) + ")",
        True,
        "the checkpoint names its PLE table with an empty shard index",
        "There is no module or parameter named",
    ),
    _p(
        "ple_weight_scale_rejected",
        "(?P<name>" + re.escape(GLOBAL_SCALE) + r")\b.*(?:no module or parameter|unexpected)",
        True,
        "this vLLM cannot load a quantized PLE table (global weight_scale)",
        GLOBAL_SCALE,
        name_before=True,
    ),
    _p(
        "free_memory_below_request",
        r"Free memory on device \S* ?\((?P<free_gib>"
        + _NUM
        + r")/(?P<total_gib>"
        + _NUM
        + r") GiB\) on startup is less than desired GPU memory utilization "
        r"\((?P<utilization>[\d.]+), (?P<requested_gib>" + _NUM + r") GiB\)",
        True,
        "other processes hold memory vLLM's utilization asks for",
        "Free memory on device",
    ),
    _p(
        "kv_cache_size",
        r"(?P<device>GPU|CPU|XPU)(?: \+ host)? KV cache size: (?P<tokens>[\d,]+) tokens, "
        r"Maximum concurrency for (?P<max_model_len>[\d,]+) tokens per request: "
        r"(?P<concurrency>" + _NUM + r")x",
        False,
        "KV cache capacity at startup",
        *(f"{d}{h} KV cache size:" for d in ("GPU", "CPU", "XPU") for h in ("", " + host")),
    ),
    _p(
        "available_kv_memory",
        r"Available KV cache memory: (?P<available_gib>" + _NUM + r") GiB",
        False,
        "KV pool after profiling",
        "Available KV cache memory:",
    ),
    _p(
        "explicit_kv_memory",
        r"(?:reserved (?P<reserved_gib>" + _NUM + r") GiB memory for KV Cache|Explicitly set "
        r"\((?P<set_gib>" + _NUM + r")/(?P<node_gib>" + _NUM + r")\) GiB for KV cache)",
        False,
        "KV pool given by --kv-cache-memory-bytes",
        "reserved ",
        "Explicitly set (",
    ),
    _p(
        "model_loading",
        r"Model loading took (?P<weights_gib>" + _NUM + r") GiB memory and "
        r"(?P<seconds>" + _NUM + r") seconds",
        False,
        "weights on the device",
        "Model loading took",
    ),
    _p(
        "graph_capture",
        r"Graph capturing finished in (?P<seconds>\d+) secs, took (?P<graph_gib>" + _NUM + r") GiB",
        False,
        "CUDA graphs captured",
        "Graph capturing finished",
    ),
    _p(
        "graph_estimate",
        r"Estimated CUDA graph memory: (?P<graph_gib>" + _NUM + r") GiB total",
        False,
        "CUDA graph memory profiled before the KV pool was sized",
        "Estimated CUDA graph memory:",
    ),
    _p(
        "block_size",
        r"Setting attention block size to (?P<block_size>\d+) tokens",
        False,
        "attention block raised so its page holds the largest state page",
        "Setting attention block size",
    ),
    _p(
        "mamba_padding",
        r"Padding mamba page size by (?P<padding_pct>" + _NUM + r")%",
        False,
        "state pages padded to the attention page",
        "Padding mamba page size",
    ),
    _p(
        "mamba_cache_mode",
        r"Mamba cache mode is set to '(?P<mode>\w+)'",
        False,
        "state blocks per request: 2 + speculative tokens under 'align'",
        "Mamba cache mode is set",
    ),
    _p(
        "cli_args",
        r"non-default args: (?P<args>\{.*\})\s*$",
        False,
        "flags vLLM was started with",
        "non-default args: ",
    ),
    _p(
        "kv_layout",
        r"Using (?P<layout>[A-Z]{5}) KV cache layout",
        False,
        "KV cache layout",
        "Using ",
    ),
    _p(
        "engine_config",
        r"Initializing a V1 LLM engine \(v(?P<version>[\w.+-]+)\) with config:"
        r"(?:(?!dtype=).)*dtype=(?P<dtype>[\w.]+),(?:(?!max_seq_len=).)*max_seq_len=(?P<max_seq_len>\d+)",
        False,
        "engine configuration",
        "Initializing a V1 LLM engine",
    ),
)
#: Leading bytes of what a log is often saved as that is not text.
_NOT_TEXT = (
    (b"\x1f\x8b", "gzip-compressed: `zcat LOG | flashnext explain -`"),
    (b"BZh", "bzip2-compressed: `bzcat LOG | flashnext explain -`"),
    (b"\xfd7zXZ\x00", "xz-compressed: `xzcat LOG | flashnext explain -`"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed: `zstdcat LOG | flashnext explain -`"),
    (b"\xff\xfe", "UTF-16: `iconv -f UTF-16 -t UTF-8 LOG | flashnext explain -`"),
    (b"\xfe\xff", "UTF-16: `iconv -f UTF-16 -t UTF-8 LOG | flashnext explain -`"),
)
_UNIT = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}


@dataclass
class Event:
    """One recognised log line: kind, 1-based line number, numbers, the line itself."""

    kind: str
    line: int
    values: dict[str, Any]
    text: str
    failure: bool
    summary: str
    options: list[dict[str, str]] = field(default_factory=list)


def log_lines(data: bytes, name: str) -> list[str]:
    """The lines of a log's bytes (UTF-8; undecodable bytes replaced).

    Raises:
        PlanError: the bytes are not a text log (compressed, UTF-16, binary), naming ``name``
            and how to turn it into text; a silent "no events" would read as a clean log.
    """
    head = data[:8192]
    for magic, what in _NOT_TEXT:
        if head.startswith(magic):
            raise PlanError(f"{name}: not a text log ({what.replace('LOG', name)})")
    if b"\x00" in head:
        # UTF-16 without a byte-order mark has a NUL in every other byte; text has none.
        raise PlanError(f"{name}: not a text log (NUL bytes: binary, or UTF-16 without a BOM)")
    return strip_ansi(data.decode("utf-8", errors="replace")).splitlines()


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escapes: a coloured log reads as the plain one (the numbers that
    follow a colour code are the numbers, not 0)."""
    return _ANSI.sub("", text) if "\x1b" in text else text


def _value(key: str, raw: str) -> Any:
    if key.endswith("unit") or key in (
        "args",
        "device",
        "layout",
        "mode",
        "name",
        "version",
        "dtype",
    ):
        return raw
    clean = raw.replace(",", "")
    return float(clean) if "." in clean else int(clean)


def _cli_args(text: str) -> dict[str, Any]:
    """The scalar entries of vLLM's "non-default args: {...}" dict (others dropped), secrets
    (``api_key``, ``hf_token``, ...) redacted."""
    if len(text) > MAX_ARGS_CHARS:
        return {}
    try:
        args = ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError):  # nested past the parser
        return {}
    if not isinstance(args, dict):
        return {}
    return {
        str(k): REDACTED if SECRET_NAME.search(str(k)) else v
        for k, v in args.items()
        if isinstance(v, (int, float, str, bool))
    }


def _normalise(kind: str, values: dict[str, Any]) -> dict[str, Any]:
    """CUDA OOM sizes in MiB whatever unit torch printed them in; vLLM's flags as a dict."""
    if kind == "cli_args":
        return _cli_args(values["args"])
    if kind != "cuda_oom":
        return values
    out = {k: v for k, v in values.items() if not k.endswith("unit")}
    for key in ("requested", "total", "free"):
        if out.get(key) is not None:
            out[f"{key}_mib"] = round(out.pop(key) * _UNIT[values[f"{key}_unit"]], 2)
        else:
            out.pop(key, None)
    return out


def read_log(lines: Iterable[str]) -> list[Event]:
    """Every recognised event in ``lines`` (first pattern that matches a line wins).

    A failure that vLLM prints twice (the engine's traceback and the API server's) is kept once.
    """
    events: list[Event] = []
    seen: set[tuple[str, str]] = set()
    for n, raw in enumerate(lines, 1):
        line = strip_ansi(raw)
        for pat in PATTERNS:
            groups = pat.match(line)
            if groups is None:
                continue
            values = {k: _value(k, v) for k, v in groups.items() if v is not None}
            values = _normalise(pat.kind, values)
            key = (pat.kind, repr(sorted(values.items())))
            if pat.failure and key in seen:
                break
            seen.add(key)
            text = f"non-default args: {values}" if pat.kind == "cli_args" else line.strip()[-400:]
            events.append(Event(pat.kind, n, values, text, pat.failure, pat.summary))
            break
    return events


def static_options(event: Event, fixed_pool: int | None = None) -> list[dict[str, str]]:
    """Options for a failure from its own numbers, cheapest first (no model needed).

    ``fixed_pool``: the ``--kv-cache-memory-bytes`` the launch set (bytes), which replaces the pool that
    ``--gpu-memory-utilization`` would size: raising the utilization then changes nothing.
    """
    v = event.values
    k = event.kind
    if k == "kv_capacity_error":
        est = v.get("estimated_max_model_len")
        out = []
        if est:
            out.append(_opt(f"--max-model-len {est}", "shorter context", "vLLM's own estimate"))
        short = v["needed_gib"] - v["available_gib"]
        if fixed_pool is not None:
            # vLLM rounds GiB to two places: scale the exact pool by the length it reached.
            want = (
                f"about {fixed_pool * v['max_model_len'] // est:,}"
                if est
                else (f"{v['needed_gib']} GiB")
            )
            out.append(
                _opt(
                    f"raise --kv-cache-memory-bytes (now {fixed_pool:,}) to {want}",
                    "GPU memory",
                    "the pool is set by that flag; --gpu-memory-utilization does not size it",
                )
            )
        else:
            out.append(
                _opt(
                    "raise --gpu-memory-utilization",
                    "less margin",
                    f"the pool is {short:.2f} GiB short (more than 0.95 risks graph capture)",
                )
            )
        out.append(_opt("--kv-cache-dtype fp8", "KV precision", "halves attention KV bytes"))
        out.append(
            _opt("--num-speculative-tokens 0 (if MTP is on)", "no MTP", "frees draft weights, KV")
        )
        return out
    if k == "mamba_blocks_error":
        pool = "--gpu-memory-utilization" if fixed_pool is None else "--kv-cache-memory-bytes"
        return [
            _opt(f"--max-num-seqs {v['num_blocks']}", "fewer sequences", "one block per sequence"),
            _opt(
                f"lower --max-model-len or raise {pool}",
                "context/margin",
                "more blocks in the pool",
            ),
        ]
    if k == "no_kv_memory" and fixed_pool is not None:
        return [_opt("raise --kv-cache-memory-bytes", "GPU memory", "the pool you set is empty")]
    return [_opt(*o) for o in _FIXED.get(k, [])]


def _opt(change: str, cost: str, why: str) -> dict[str, str]:
    return {"change": change, "cost": cost, "why": why}


_FIXED: dict[str, list[tuple[str, str, str]]] = {
    "cuda_oom": [
        (
            "lower --max-num-seqs / --max-num-batched-tokens",
            "throughput",
            "smaller transient buffers (GDN state temporaries, MoE workspaces)",
        ),
        ("lower --gpu-memory-utilization", "KV capacity", "leaves room outside vLLM's pool"),
        (
            "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments",
            "none",
            "the seeds saw it fail at startup with the PLE offload worker",
        ),
    ],
    "no_kv_memory": [
        ("raise --gpu-memory-utilization or quantize weights", "margin / precision", ""),
    ],
    "graph_capture_failed": [
        ("--enforce-eager", "decode speed", "no graphs: confirms the cause and boots"),
        (
            '--compilation-config \'{"cudagraph_mode": "PIECEWISE"}\'',
            "some decode speed",
            "attention (and custom ops beside it) run outside the graphs",
        ),
        (
            "check plugins and custom ops for a host sync or copy inside the forward",
            "none",
            "a .item(), .cpu() or a synchronize cannot be captured",
        ),
    ],
    "kv_alloc_oom": [
        (
            "lower --gpu-memory-utilization (or set --kv-cache-memory-bytes)",
            "KV capacity",
            "the pool was sized from memory that was no longer free when it was allocated",
        ),
        ("stop other processes on the GPU (nvidia-smi)", "none", "they took memory meanwhile"),
    ],
    "stalled_while_loading": [
        (
            "watch the disk (iostat -x 5; a network filesystem or a cold page cache reads slowly)",
            "none",
            "the shards stopped arriving",
        ),
        (
            "copy the checkpoint to local NVMe, or warm it first (vmtouch / cat > /dev/null)",
            "disk space / time",
            "",
        ),
        ("flashnext checkpoint verify DIR", "a read of the checkpoint", "a truncated shard"),
    ],
    "host_oom": [
        (
            "a quantized PLE table (flashnext ple quantize) served mmapped",
            "an int4/nvfp4 sidecar",
            "host RAM becomes reclaimable page cache",
        ),
        ("raise the commit limit (vm.overcommit_memory) or add swap", "host policy", ""),
    ],
    "pidfd_getfd": [
        ("docker run --cap-add=SYS_PTRACE", "a capability", "seccomp denies pidfd_getfd"),
        ("sysctl kernel.yama.ptrace_scope=0 (bare metal)", "host policy", "Yama blocks it"),
        ("unset expandable_segments", "none", "the seeds hit it after an allocator OOM"),
    ],
    "ple_empty_shard_name": [
        (
            "load with flashnext's PLE loader (accepts shard_. after the shape check)",
            "a plugin",
            "",
        ),
    ],
    "ple_weight_scale_rejected": [
        (
            "serve the table from a flashnext sidecar, or an offload worker that knows FP8",
            "a plugin",
            "",
        ),
    ],
    "free_memory_below_request": [
        (
            "lower --gpu-memory-utilization to the free share",
            "KV capacity",
            "utilization is a share of the whole GPU, not of free memory",
        ),
    ],
}


def _stall_after_graphs(lines: list[str], events: list[Event]) -> Event | None:
    """Seed 004: with pidfd_getfd denied, the PLE offload boot hangs after graph capture and
    prints nothing; a log that captured graphs, never completed startup and shows no failure
    gets this event."""
    capture = [e for e in events if e.kind == "graph_capture"]
    if not capture or any(e.failure for e in events):
        return None
    if any("Application startup complete" in line for line in lines):
        return None
    return Event(
        "stalled_after_graph_capture",
        capture[-1].line,
        {},
        capture[-1].text,
        True,
        "startup stopped after graph capture with no error (the PLE offload worker waiting for "
        "a CUDA IPC descriptor it may not take: pidfd_getfd / ptrace)",
        [_opt(*o) for o in _FIXED["pidfd_getfd"]],
    )


_SHARDS = _p(
    "loading",
    r"Loading (?:safetensors )?checkpoint shards:.*?\b(?P<done>\d+)/"
    r"(?P<total>\d+)\b",
    False,
    "loading weights",
    "Loading checkpoint shards:",
    "Loading safetensors checkpoint shards:",
)


def _stall_while_loading(lines: list[str], events: list[Event]) -> Event | None:
    """A log whose last word is a weight-loading progress line short of its total, with no
    failure: the load stopped (a stalled read, a hung process) or is still crawling."""
    if any(e.failure for e in events) or any(e.kind == "model_loading" for e in events):
        return None
    for number in range(len(lines), 0, -1):
        found = _SHARDS.match(lines[number - 1])
        if found is None:
            continue
        done, total = int(found["done"]), int(found["total"])
        if done >= total:
            return None
        return Event(
            "stalled_while_loading", number, {"shards_loaded": done, "shards": total},
            lines[number - 1].strip(), True,
            f"the log ends while loading weights ({done} of {total} checkpoint shards) with no "
            "error: the reads stalled, or are still crawling",
        )  # fmt: skip
    return None


def _oom_in_kv_allocation(lines: list[str], events: list[Event]) -> None:
    """A GPU OOM raised while the KV pool itself was allocated (its traceback names the
    allocation) is about the pool's size, not transient buffers: relabel it."""
    for e in events:
        if e.kind != "cuda_oom":
            continue
        context = "\n".join(lines[max(0, e.line - 60) : e.line])
        if "_allocate_kv_cache_tensors" in context or "initialize_kv_cache" in context:
            e.kind = "kv_alloc_oom"
            e.summary = "the KV pool could not be allocated: less memory was free than sized"


def explain_log(text: Iterable[str]) -> list[Event]:
    """:func:`read_log` with :func:`static_options` filled in for every failure, plus a stall
    after graph capture or during weight loading when the log ends there."""
    lines = list(text)
    events = read_log(lines)
    _oom_in_kv_allocation(lines, events)
    for stall in (_stall_after_graphs(lines, events), _stall_while_loading(lines, events)):
        if stall is not None:
            events.append(stall)
    fixed_pool = logged_kv_memory_bytes(events)
    allocator_set = any("expandable_segments" in line for line in lines)
    for e in events:
        if e.failure and not e.options:
            e.options = static_options(e, fixed_pool)
        if not allocator_set:  # advice to unset what this launch never set is noise
            e.options = [o for o in e.options if "expandable_segments" not in o["change"]]
    return events


def logged_kv_memory_bytes(events: list[Event]) -> int | None:
    """The ``--kv-cache-memory-bytes`` the logged launch set (from vLLM's "non-default args",
    else its "Explicitly set"/"reserved ... for KV Cache" line), or None when it set none."""
    for e in events:
        if e.kind == "cli_args" and isinstance(e.values.get("kv_cache_memory_bytes"), int):
            return int(e.values["kv_cache_memory_bytes"])
    for e in events:
        if e.kind == "explicit_kv_memory":
            gib = e.values.get("set_gib", e.values.get("reserved_gib"))
            return int(gib * (1 << 30)) if gib is not None else None
    return None


def logged_kv_pool(events: list[Event]) -> int | None:
    """The KV pool (bytes) of the last "Available KV cache memory" or KV capacity error line."""
    for e in reversed(events):
        if e.kind in ("available_kv_memory", "kv_capacity_error"):
            return int(e.values["available_gib"] * (1 << 30))
    return None
