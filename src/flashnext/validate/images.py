"""A test image made on the fly: a PNG written with zlib and struct, no imaging library."""

from __future__ import annotations

import base64
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def make_png(width: int = 64, height: int = 64) -> bytes:
    """An 8-bit RGB PNG: a colour gradient with a red square in the middle.

    Raises ValueError for a size outside 1..4096 (servers reject degenerate images anyway).
    """
    if not (1 <= width <= 4096 and 1 <= height <= 4096):
        raise ValueError(f"image size {width}x{height}: expected 1..4096 on each side")
    rows = []
    for y in range(height):
        row = bytearray([0])  # filter type 0 (None) for every scanline
        for x in range(width):
            if width // 4 <= x < 3 * width // 4 and height // 4 <= y < 3 * height // 4:
                row += b"\xff\x00\x00"
            else:
                row += bytes((x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), 128))
        rows.append(bytes(row))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, colour type 2 = RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + _chunk(b"IEND", b"")
    )


def png_data_url(png: bytes) -> str:
    """``data:image/png;base64,...`` for an OpenAI ``image_url`` content part."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")
