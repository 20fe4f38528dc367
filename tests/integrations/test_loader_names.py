"""Name handling and signature detection of the vLLM patches (pure Python, no vLLM needed)."""

from __future__ import annotations

import pytest

from flashnext.integrations.vllm.b12x import SHARED_PARAMS, accepts_shared_buffers
from flashnext.integrations.vllm.loader import EMPTY_SHARD, relative_name


@pytest.mark.parametrize(
    "name",
    [
        "model.language_model.layers.3.ple.ple_embedding.ngram_embedding.shard_.weight",
        "model.layers.3.ple.ple_embedding.ngram_embedding.shard_.weight",
        "language_model.model.layers.3.ple.ple_embedding.ngram_embedding.shard_.weight",
        "ple_embedding.ngram_embedding.shard_.weight",
        "ngram_embedding.shard_.weight",
    ],
)
def test_every_prefix_reaches_the_empty_shard_branch(name):
    assert relative_name(name) == EMPTY_SHARD


@pytest.mark.parametrize(
    "name",
    [
        "layer_multipliers",
        "model.layers.3.ple.ple_proj.weight",
        "model.layers.3.mlp.ngram_embedding.weight",  # not under a PLE layer: left alone
    ],
)
def test_other_names_are_left_alone(name):
    assert relative_name(name) == name


def test_shared_buffer_detection_reads_the_constructor_signature():
    def old(num_experts, top_k, *, use_cuda_graph=False): ...

    def new(num_experts, top_k, *, shared_static_workspace=None, shared_dynamic_workspace=None,
            shared_output=None): ...  # fmt: skip

    def partial(num_experts, *, shared_output=None): ...

    assert accepts_shared_buffers(new) and len(SHARED_PARAMS) == 3
    assert not accepts_shared_buffers(old)
    assert not accepts_shared_buffers(partial)
    assert not accepts_shared_buffers(len)  # a builtin without a signature
