"""Build small image folders on disk for the data tests (real PNG and JPEG files via Pillow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("cat", "dog", "eel")


def make_image(path: Path, size: tuple[int, int], mode: str, seed: int, label: int) -> None:
    """A learnable image: a class-dependent colour band plus noise, saved as `path`'s format."""
    rng = np.random.default_rng(seed)
    width, height = size
    pixels = rng.integers(0, 60, (height, width, 3), dtype=np.uint8)
    band = slice(label * height // len(CLASSES), (label + 1) * height // len(CLASSES))
    pixels[band] += np.uint8(150)
    if path.suffix != ".png" and mode == "RGBA":  # JPEG has no alpha channel
        mode = "RGB"
    image = Image.fromarray(pixels, "RGB").convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def make_folder(
    root: Path,
    per_class: dict[str, int],
    *,
    size=(16, 16),
    mixed=False,
    modes=("RGB",),
    extensions=(".png",),
) -> Path:
    """root/<split>/<class>/<i>.<ext>: `per_class` images per class and split.

    mixed=True alternates the size between `size` and a larger one; modes and extensions cycle.
    """
    index = 0
    for split, count in per_class.items():
        for label, name in enumerate(CLASSES):
            for i in range(count):
                this_size = (size[0] + 8, size[1] + 4) if mixed and i % 2 else size
                ext = extensions[index % len(extensions)]
                mode = modes[index % len(modes)]
                make_image(root / split / name / f"{i}{ext}", this_size, mode, index, label)
                index += 1
    return root
