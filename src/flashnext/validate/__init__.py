"""Staged checks of a live OpenAI-compatible server (vLLM first, SGLang too).

``stages`` runs the checks (measures from ``stats``) with ``probes``
watching restarts, server gauges and GPU memory, and returns a typed ``ValidationResult``;
``report`` turns it into report.json (a record) / report.md / report.png. Only HTTP (plus NVML
and the container runtime for the probes) is used, so the server may be local or remote.
"""
