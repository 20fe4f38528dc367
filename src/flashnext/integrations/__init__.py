"""Thin integrations of flashnext into serving runtimes (vLLM); the logic lives elsewhere."""
