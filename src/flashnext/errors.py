"""One error root for flashnext, a subclass per area.

Every message names the file, tensor, shape or flag at fault, what was expected, and
where there is one, the fix. The CLI prints ``error: <message>`` and exits 1; it prints an
``OSError`` (a path that cannot be read or written) the same way, naming the path.
"""

from __future__ import annotations


class FlashnextError(Exception):
    """Root of every error flashnext raises on purpose."""


class MissingExtraError(FlashnextError, ImportError):
    """An optional dependency is not installed; the message says what to install."""


class GeometryError(FlashnextError, ValueError):
    """A model config or checkpoint buffer does not describe a valid PLE geometry."""


class FormatError(FlashnextError, ValueError):
    """Tensors do not match a PLE table format (dtype, shape, names)."""


class SafetensorsError(FlashnextError, ValueError):
    """A file is not a valid safetensors file; the message names the file and field."""


class RowIdError(FlashnextError, IndexError):
    """A row id given to a lookup is outside the table (or not an integer)."""


class SidecarError(FlashnextError):
    """A sidecar directory is missing, incomplete or inconsistent."""


class DestinationError(FlashnextError):
    """A command may not write where it was asked to (what is there, or another writer)."""


class CheckpointError(FlashnextError):
    """A model checkpoint on disk is incomplete or has an unexpected layout."""


class ValidationError(FlashnextError):
    """The deployment validator could not run (bad flags, unreachable server at start)."""


class KernelError(FlashnextError):
    """A GPU lookup table cannot be built or used as asked (placement, ids, buffers)."""


class PluginError(FlashnextError):
    """The vLLM plugin cannot apply a patch it was asked for (version, layout, settings)."""
