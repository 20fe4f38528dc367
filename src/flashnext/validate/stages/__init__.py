"""The validation stages and the runner that executes them with the probes running throughout.

Stages, in run order (:data:`STAGES`): ``ready``, ``short``, ``long``, ``multimodal``
(:mod:`.single`), ``concurrency``, ``sustained`` (:mod:`.load`), ``prefix-cache`` (:mod:`.cache`).
Each fills a :class:`StageResult`: ``pass``, ``fail`` or ``skip`` with a reason (or
``interrupted``), the headline numbers (``key``) and the evidence. :func:`run_validation`
(:mod:`.runner`) returns a :class:`ValidationResult`. Prompts live in
:mod:`flashnext.validate.stages.prompts`, statistics in :mod:`flashnext.validate.stats`.
"""

from flashnext.validate.stages.config import STAGES, Config
from flashnext.validate.stages.prompts import essay_prompt
from flashnext.validate.stages.result import (
    STATUSES,
    Interruption,
    ServerEnvironment,
    StageResult,
    ValidationResult,
)
from flashnext.validate.stages.run import ProgressFn, Run
from flashnext.validate.stages.runner import STAGE_FUNCS, run_validation
from flashnext.validate.stats import load_stats, percentiles

__all__ = [
    "STAGES",
    "STAGE_FUNCS",
    "STATUSES",
    "Config",
    "Interruption",
    "ProgressFn",
    "Run",
    "ServerEnvironment",
    "StageResult",
    "ValidationResult",
    "essay_prompt",
    "load_stats",
    "percentiles",
    "run_validation",
]
