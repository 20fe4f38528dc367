"""flashnext: serve Flash-Next-class models (vLLM ``Qwen4Exp``) on the hardware people have."""

__version__ = "0.1.0"
