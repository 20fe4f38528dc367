"""flashnext's vLLM general plugin (entry point group ``vllm.general_plugins``).

Inert unless switched on (``FLASHNEXT_PLE_SIDECAR=DIR``, ``FLASHNEXT_MOE_GUARD=1`` or the
equivalent ``--additional-config`` keys). Each patch module exposes ``install(...) -> str``
(idempotent, returns its one log line); ``register`` checks the vLLM version and every
precondition first, then applies, so a patch is never half-applied.
"""
