"""The explorer's PNG encoder: what it writes decodes (PIL, which checks zlib's Adler-32) to the exact pixels,
frame after frame, and a frame that changes a few rows recompresses only the bands holding them."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from workbench.viz.png import BandEncoder, _adler32_combine


def _decode(data: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    image.load()
    return np.asarray(image)


@pytest.mark.parametrize("channels", [3, 4])
def test_frames_decode_to_their_pixels(channels: int) -> None:
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (37, 29, channels), dtype=np.uint8)  # rows not a multiple of the band
    encoder = BandEncoder(band_rows=8)
    for step in range(4):
        frame = frame.copy()
        frame[5 * step : 5 * step + 3, 3:20] = step * 40
        np.testing.assert_array_equal(_decode(encoder.encode(frame)), frame)


def test_only_changed_bands_are_compressed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = np.zeros((64, 50, 4), dtype=np.uint8)
    encoder = BandEncoder(band_rows=16)
    encoder.encode(frame)
    compressed = []
    real = zlib.compressobj
    monkeypatch.setattr(zlib, "compressobj", lambda *a: compressed.append(a) or real(*a))
    frame[20:22, 10:30] = 255  # rows 20-21: the second band only
    np.testing.assert_array_equal(_decode(encoder.encode(frame)), frame)
    assert len(compressed) == 1


def test_adler32_combine_is_zlibs() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        a = rng.integers(0, 256, int(rng.integers(0, 300_000)), dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, int(rng.integers(0, 300_000)), dtype=np.uint8).tobytes()
        assert _adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_a_wrong_frame_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(h, w, 3 or 4\) uint8"):
        BandEncoder().encode(np.zeros((4, 4, 2), dtype=np.uint8))
