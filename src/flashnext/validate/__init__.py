"""Staged checks of a live OpenAI-compatible server (vLLM first, SGLang too).

``stages`` runs the checks with ``probes`` watching restarts, server gauges and GPU memory;
``report`` writes report.json / report.md / report.png. Only HTTP (plus NVML and the container
runtime for the probes) is used, so the server may be local or remote.
"""
