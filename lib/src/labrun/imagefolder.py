"""The `folder` dataset: DIR/train/<class>/<images>, optional DIR/val/..., DIR/test/...

The scan lists the images, refuses layouts that would train wrong (a class folder that is a link
to another class, one image under two labels or in two splits), and decodes every image once to
check it: a file that fails only when fully decoded (a truncated JPEG whose header reads) is
skipped and listed here, not found later inside a DataLoader worker. The result is cached in
--data-dir per version of the folder (dataversion.py), so a later start only lists the folders.
Images are decoded later with `decode_image`: once, into imagecache.py's memory-mapped cache,
or batch by batch in loader workers (--data-mode stream). Pillow and numpy (torch only for the
resize, imported when an image is decoded: the scan stays torch-free); imports nothing of the
data layer but dataversion (datasets.py turns a scan into DatasetSplits).

How an image becomes pixels: lib/README.md, "How an image becomes pixels". A JPEG much larger
than the target is decoded at a reduced DCT scale (Image.draft); no copy is made that changes
nothing (an upright image is not transposed, an RGB one not converted).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps

from .dataversion import CHECK_PREFIX, VERSION_PREFIX, cache_file, file_lock, read_json_cache
from .runs import atomic_write_text

if TYPE_CHECKING:
    import torch

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".gif", ".bmp")
# Unreadable files are skipped (and listed) up to this fraction of the images; above it the
# folder is more likely wrong than a few files damaged, and the run refuses to start.
MAX_UNREADABLE_FRACTION = 0.01
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
INT_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N"})  # more than 8 bits
BIT_DEPTHS = (8, 10, 12, 14, 16, 24, 32)
EXIF_ORIENTATION = 0x0112
TRANSPOSED = frozenset({5, 6, 7, 8})  # orientations that swap width and height
# What Pillow raises for a file it cannot decode (SyntaxError: some truncated headers).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class UnreadableImage(ValueError):
    """An image that cannot be decoded: names the file (run.py: one `error:` line, exit 2).
    UnreadableImage(path, reason): its args, as a loader worker sends it pickled."""

    def __str__(self) -> str:
        return "cannot decode {}: {}".format(*self.args)


def scan_image_folder(
    root: Path, image_size: tuple[int, int] | None, report_dir: Path, version: str
) -> dict:
    """Find the images of `root`, check them, and describe the dataset (one-line errors): the
    keyword arguments of the `folder` dataset's DatasetSplits, a split as (paths, labels) (no
    key for a split without a readable image). `version` keys the cached checks in `report_dir`.
    `root`, `report_dir`: Paths (datasets.folder gives load_dataset's).
    """
    if not (root / "train").is_dir():
        raise ValueError(
            f"--data-path: {root / 'train'} is not a folder; expected "
            "DIR/train/<class>/*.png|jpg (and optionally DIR/val, DIR/test)"
        )
    class_names = [p.name for p in _class_dirs(root / "train")]
    if not class_names:
        raise ValueError(
            f"--data-path: {root / 'train'} has no class folders (expected train/<class>/*.png)"
        )
    files, others = _list_images(root, class_names)  # every class of train has an image
    checked = _check_images(
        root, [p for found in files.values() for p, _ in found], report_dir, version
    )
    total = len(checked)
    readable = {
        s: [(p, y) for p, y in found if not isinstance(checked[p], str)]
        for s, found in files.items()
    }
    unreadable = [f"{p}\t{why}" for p, why in checked.items() if isinstance(why, str)]
    infos = [info for info in checked.values() if not isinstance(info, str)]  # (w, h, mode, ...)
    sizes, modes = {(w, h) for w, h, *_ in infos}, {mode for _, _, mode, _, _ in infos}
    int_max = max((high for _, _, mode, _, high in infos if mode in INT_MODES), default=0)
    floats = [(low, high) for _, _, mode, low, high in infos if mode == "F"]
    float_range = (min([0.0, *(lo for lo, _ in floats)]), max([1.0, *(hi for _, hi in floats)]))
    notes = []
    if others:
        counts = ", ".join(f"{ext or 'no extension'}: {n}" for ext, n in others.most_common())
        notes.append(
            f"ignored {sum(others.values())} file(s) that are not images ({counts}); "
            f"read are {', '.join(IMAGE_EXTENSIONS)}"
        )
    if unreadable:
        # Next to the caches (the data folder may be read-only; _check_images' lock made the
        # folder), replaced atomically: a link planted at its name is replaced, never written
        # through.
        listing = cache_file(root, report_dir, "unreadable-images-", ".txt")
        atomic_write_text(listing, "\n".join(unreadable) + "\n")
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
    bits = next((b for b in BIT_DEPTHS if int_max < 2**b), BIT_DEPTHS[-1])
    return dict(
        **{s: tuple(zip(*found, strict=True)) for s, found in readable.items() if found},
        class_names=class_names,
        channels=1 if modes <= GREY_MODES else 3,  # RGBA, palette, CMYK... become RGB
        image_size=image_size,
        notes=notes,
        value_ranges={"int": (0.0, float(2**bits - 1)), "float": float_range},
    )


def _list_images(root: Path, class_names: list[str]):
    """{split: [(path, label)]} of every image, and a Counter of other files by extension.
    Refuses one image under two labels or in two splits (links): it would be learned twice."""
    files: dict[str, list[tuple[str, int]]] = {}
    others: Counter = Counter()
    # An image by its file, not its name: a symlink, a linked folder or a hard link (cp -al,
    # DVC's cache, which keeps no path in common) is the same (st_dev, st_ino).
    owner: dict[tuple[int, int], str] = {}  # -> "split/class (path)" that has it
    for split in [s for s in ("train", "val", "test") if (root / s).is_dir()]:
        files[split] = []
        for class_dir in _class_dirs(root / split):
            if class_dir.name not in class_names:
                raise ValueError(
                    f"--data-path: class {class_dir.name!r} is in {split}/ but not "
                    f"in train/ (train has: {', '.join(class_names)})"
                )
            listed = len(files[split])
            for entry in sorted(os.scandir(class_dir), key=lambda e: e.name):
                ext = os.path.splitext(entry.name)[1].lower()
                if entry.name.startswith(".") or not entry.is_file():  # hidden: never data
                    continue
                if ext not in IMAGE_EXTENSIONS:
                    others[ext] += 1
                    continue
                st = entry.stat()  # follows a symlink: its target's inode
                if (st.st_dev, st.st_ino) in owner:
                    raise ValueError(
                        f"--data-path: {entry.path} is the same image as one in "
                        f"{owner[st.st_dev, st.st_ino]}: an image may be in one class and one "
                        "split only"
                    )
                owner[st.st_dev, st.st_ino] = f"{split}/{class_dir.name} ({entry.path})"
                files[split].append((entry.path, class_names.index(class_dir.name)))
            if split == "train" and len(files[split]) == listed:
                raise ValueError(
                    f"--data-path: class folder {class_dir} has no images "
                    f"({', '.join(IMAGE_EXTENSIONS)})"
                )
    return files, others


def _class_dirs(folder: Path) -> list[Path]:
    """The class folders of a split's folder, sorted: its folders but hidden ones."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _check_images(root: Path, paths: list[str], report_dir: Path, version: str):
    """{path: [width, height, mode, low, high] or "why unreadable"}, cached per version: every
    image fully decoded once (a file cut short fails here), sizes after EXIF orientation."""
    cache = report_dir / f"{CHECK_PREFIX}{root.name}-{version.removeprefix(VERSION_PREFIX)}.json"
    relative = [os.path.relpath(p, root) for p in paths]  # the folder may move: its cache stays
    # A --data-dir that cannot hold it: one error line (data.load_dataset names the flag).
    with file_lock(cache):
        checked = read_json_cache(cache) or {}
        if not all(r in checked for r in relative):
            checked = {r: _inspect(p) for r, p in zip(relative, paths, strict=True)}
            atomic_write_text(cache, json.dumps(checked))
    return {p: checked[r] for p, r in zip(paths, relative, strict=True)}


def _inspect(path: str) -> list | str:
    try:
        with Image.open(path) as image:
            image.load()  # the whole file: a truncated one fails here, with a reason
            turned = image.getexif().get(EXIF_ORIENTATION, 1) in TRANSPOSED
            width, height = image.size[::-1] if turned else image.size
            low, high = image.getextrema() if image.mode in INT_MODES | {"F"} else (0, 255)
            return [width, height, image.mode, float(low), float(high)]  # as JSON reads it
    except DECODE_ERRORS as e:
        return f"{type(e).__name__}: {e}"


def decode_image(
    path: str,
    size: tuple[int, int],
    channels: int,
    value_ranges: dict[str, tuple[float, float]] | None = None,
) -> np.ndarray:
    """One image as uint8 (height, width, channels): oriented, converted, resized, cropped.
    `value_ranges`: {"int": (low, high), "float": (low, high)} mapped onto 0..255 for images of
    more than 8 bits (from the scan; default: the mode's own range). Raises UnreadableImage."""
    import torch  # here: the scan stays torch-free

    height, width = size
    try:
        with Image.open(path) as image:
            w, h = image.size  # as stored; the target as stored too (turned: width and height)
            orientation = image.getexif().get(EXIF_ORIENTATION, 1)
            target = (height, width) if orientation in TRANSPOSED else (width, height)
            scale = max(target[0] / w, target[1] / h)
            # JPEG only: decode at a reduced DCT scale that still covers the target.
            image.draft(None, (round(w * scale + 0.5), round(h * scale + 0.5)))
            if orientation != 1:  # exif_transpose copies even an upright image: 1 ms at 500 px
                image = ImageOps.exif_transpose(image)
            image = _to_8bit(image, channels, value_ranges or {})
            # A bytearray: writable, so torch takes it without a warning (one copy, ~50 us).
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    except DECODE_ERRORS as e:
        raise UnreadableImage(path, f"{type(e).__name__}: {e}") from e
    hwc = pixels.view(image.height, image.width, channels)
    return cover_resize(hwc.permute(2, 0, 1), height, width).permute(1, 2, 0).numpy()


def _to_8bit(image: Image.Image, channels: int, value_ranges: dict) -> Image.Image:
    mode = image.mode
    if mode in INT_MODES or mode == "F":
        default = (0.0, 1.0) if mode == "F" else (0.0, 65535.0 if "16" in mode else 2.0**31 - 1)
        low, high = value_ranges.get("float" if mode == "F" else "int", default)
        values = (np.asarray(image, dtype=np.float64) - low) * (255 / max(high - low, 1e-12))
        # The scan's range holds every value; the clip only guards a file changed since.
        image = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")
    elif image.has_transparency_data:  # alpha, or a palette's transparent colour
        rgba = image.convert("RGBA")  # composited on white, as image viewers show it
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    target = "L" if channels == 1 else "RGB"
    return image if image.mode == target else image.convert(target)  # convert() always copies


def cover_resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (C, h, w) -> uint8 (C, height, width) on the image's device (or N images of one
    size): its centered part with the aspect ratio of width x height, resized (antialiased
    bilinear), for the CPU and the GPU decode alike. On the CPU on the uint8 pixels (0.17 ms for
    375x375 -> 224x224 on one core, 0.92 ms for Pillow's, values within 1 of Pillow's); other
    devices resize in float32, rounded."""
    import torch.nn.functional as F

    *_, h, w = image.shape
    if (h, w) == (height, width):
        return image
    scale = max(width / w, height / h)
    crop_w, crop_h = min(round(width / scale), w), min(round(height / scale), h)
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    window = image[..., top : top + crop_h, left : left + crop_w]
    window = window if window.ndim == 4 else window[None]
    if image.device.type != "cpu":  # uint8 interpolation: the CPU only
        window = window.float()
    resized = F.interpolate(window, size=(height, width), mode="bilinear", antialias=True)
    if image.device.type != "cpu":
        resized = resized.round().clamp(0, 255).byte()
    return resized if image.ndim == 4 else resized[0]
