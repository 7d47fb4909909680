"""The `folder` dataset: DIR/train/<class>/*.{png,jpg,jpeg}, optional DIR/val/..., DIR/test/...

Scanning reads only each file's header (size and mode), so it is cheap next to decoding; images
are decoded later, by data.py, either once into RAM or batch by batch in DataLoader workers.
Torch-free: Pillow and numpy only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from PIL import Image

from .datasets import DatasetSplits, ImageFiles

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
SPLIT_DIRS = ("train", "val", "test")
# Unreadable files are skipped (and listed) up to this fraction of the images; above it the
# folder is more likely wrong than a few files damaged, and the run refuses to start.
MAX_UNREADABLE_FRACTION = 0.01
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})


def scan_image_folder(
    root: Path | None, image_size: tuple[int, int] | None, report_dir: Path | None = None
) -> DatasetSplits:
    """Find the images of `root`, check them, and describe the dataset (one-line errors)."""
    if root is None:
        raise ValueError(
            "--data-path: the folder dataset needs --data-path DIR (DIR/train/<class>/*.png)"
        )
    root = Path(root)
    if not (root / "train").is_dir():
        raise ValueError(
            f"--data-path: {root / 'train'} is not a folder; expected "
            "DIR/train/<class>/*.png|jpg (and optionally DIR/val, DIR/test)"
        )
    class_names = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    if not class_names:
        raise ValueError(
            f"--data-path: {root / 'train'} has no class folders (expected train/<class>/*.png)"
        )
    files: dict[str, list[tuple[Path, int]]] = {}
    for split in SPLIT_DIRS:
        split_dir = root / split
        if not split_dir.is_dir():
            continue
        found = []
        for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            if class_dir.name not in class_names:
                raise ValueError(
                    f"--data-path: class {class_dir.name!r} is in {split}/ but not "
                    f"in train/ (train has: {', '.join(class_names)})"
                )
            images = sorted(
                p
                for p in class_dir.iterdir()
                if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
            )
            if not images and split == "train":
                raise ValueError(
                    f"--data-path: class folder {class_dir} has no images "
                    f"({', '.join(IMAGE_EXTENSIONS)})"
                )
            found += [(p, class_names.index(class_dir.name)) for p in images]
        files[split] = found
    total = sum(map(len, files.values()))
    if total == 0:
        raise ValueError(f"--data-path: no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")

    sizes, modes, unreadable, readable = set(), set(), [], {}
    for split, found in files.items():
        readable[split] = []
        for path, label in found:
            try:
                with Image.open(path) as image:  # reads the header only
                    sizes.add(image.size)
                    modes.add(image.mode)
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                unreadable.append(f"{path}\t{type(e).__name__}: {e}")
                continue
            readable[split].append((path, label))
    notes = []
    if unreadable:
        listing = _write_unreadable_list(root, unreadable, report_dir)
        if len(unreadable) > MAX_UNREADABLE_FRACTION * total:
            raise ValueError(
                f"--data-path: {len(unreadable)} of {total} images are unreadable "
                f"(more than {100 * MAX_UNREADABLE_FRACTION:g}%; list in {listing})"
            )
        notes.append(f"skipped {len(unreadable)} unreadable image(s) of {total}; list in {listing}")
    if not readable["train"]:
        raise ValueError(f"--data-path: no readable training images under {root / 'train'}")
    if image_size is None:
        if len(sizes) > 1:
            examples = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3])
            raise ValueError(
                f"--image-size: the images have {len(sizes)} different sizes "
                f"(e.g. {examples}); pass --image-size N to resize them all to NxN"
            )
        ((width, height),) = sizes
        image_size = (height, width)
    channels = 1 if modes <= GREY_MODES else 3  # RGBA, palette, CMYK... become RGB

    def split_files(split: str) -> ImageFiles | None:
        if split not in readable or not readable[split]:
            return None
        return ImageFiles([str(p) for p, _ in readable[split]], [y for _, y in readable[split]])

    return DatasetSplits(
        train=split_files("train"),
        val=split_files("val"),
        test=split_files("test"),
        class_names=class_names,
        channels=channels,
        image_size=image_size,
        notes=notes,
    )


def _write_unreadable_list(root: Path, lines: list[str], report_dir: Path | None) -> Path:
    """The list goes next to the caches (the data folder may be read-only)."""
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:8]
    listing = Path(report_dir or root) / f"unreadable-images-{root.name}-{key}.txt"
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text("\n".join(lines) + "\n")
    return listing


def decode_image(path: str, size: tuple[int, int], channels: int) -> np.ndarray:
    """One image as uint8 (height, width, channels), converted and resized (bilinear)."""
    height, width = size
    try:
        with Image.open(path) as image:
            # JPEG only: decode at a reduced DCT scale that is still >= the target size.
            image.draft("L" if channels == 1 else "RGB", (width, height))
            image = image.convert("L" if channels == 1 else "RGB")
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot decode {path}: {e}") from e
    return pixels.reshape(height, width, channels)
