"""A PNG encoder for pictures that change a little between frames (the explorer's rank changes).

``BandEncoder.encode(rgba)`` compresses the image in bands of rows, each band a deflate stream of its own
(byte-aligned, no reference into another band), so a band equal to the same band of an earlier frame reuses
its compressed bytes: an outline moved on a large figure costs the few bands it touches, not the whole image.
The output is an ordinary 8-bit RGB or RGBA PNG (one zlib stream, no row filters).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["BandEncoder"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class BandEncoder:
    """Encodes frames of one size as PNGs, reusing the compressed bands that did not change."""

    def __init__(self, band_rows: int = 16, level: int = 1) -> None:
        self.band_rows = band_rows
        self.level = level
        self._bands: dict[int, tuple[np.ndarray, bytes, int]] = {}  # top row -> (rows, deflated, adler32)
        self._shape: tuple[int, int] | None = None

    def encode(self, rgba: np.ndarray) -> bytes:
        """PNG bytes of an ``(height, width, 3 or 4)`` uint8 image (RGB or RGBA, as given)."""
        if rgba.ndim != 3 or rgba.shape[2] not in (3, 4) or rgba.dtype != np.uint8:
            raise ValueError(f"BandEncoder.encode wants an (h, w, 3 or 4) uint8 array, got {rgba.shape} {rgba.dtype}")
        height, width = rgba.shape[:2]
        if self._shape != (height, width):
            self._bands.clear()
            self._shape = (height, width)
        channels = rgba.shape[2]
        rows = np.empty((height, 1 + channels * width), dtype=np.uint8)
        rows[:, 0] = 0  # filter type None on every row
        rows[:, 1:] = np.ascontiguousarray(rgba).reshape(height, channels * width)
        parts = [b"\x78\x01"]  # zlib header: deflate, 32 KiB window
        checksum = 1
        for top in range(0, height, self.band_rows):
            band = rows[top : top + self.band_rows]
            cached = self._bands.get(top)
            if cached is None or not np.array_equal(cached[0], band):
                compressor = zlib.compressobj(self.level, zlib.DEFLATED, -15)
                packed = compressor.compress(band) + compressor.flush(zlib.Z_SYNC_FLUSH)
                cached = self._bands[top] = (band.copy(), packed, zlib.adler32(band))
            parts.append(cached[1])
            checksum = _adler32_combine(checksum, cached[2], band.size)
        parts.append(b"\x03\x00")  # an empty final block
        parts.append(struct.pack(">I", checksum))
        header = struct.pack(">IIBBBBB", width, height, 8, 6 if channels == 4 else 2, 0, 0, 0)
        return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


_BASE = 65521


def _adler32_combine(first: int, second: int, second_length: int) -> int:
    """The Adler-32 of two byte strings joined, from each one's (zlib's adler32_combine)."""
    rem = second_length % _BASE
    sum1 = first & 0xFFFF
    sum2 = (rem * sum1) % _BASE
    sum1 += (second & 0xFFFF) + _BASE - 1
    sum2 += ((first >> 16) & 0xFFFF) + ((second >> 16) & 0xFFFF) + _BASE - rem
    sum1 %= _BASE
    sum2 %= _BASE
    return sum1 | (sum2 << 16)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
