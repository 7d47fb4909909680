"""Your datasets (`--dataset`): one decorated function each, returning DatasetSplits.

A split is `(inputs, targets)`, arrays of any numeric dtype and shape: (N, L) vectors,
(N, C, L) signals, (N, C, H, W) images, (N, T, F) sequences (`layout="NTF"`). The library
keeps them as they are, normalises each channel with the training split's mean and std (uint8
images: fixed constants; `normalize=False`: not at all), augments uint8 images only unless
--augment or `augment=` says otherwise, and carves val and test out of train where missing.
The library's own: digits, cifar10, synthetic, folder (labrun.datasets). A loop may register
variants: `register_dataset(name, help=...)(function)`. Keep heavy imports inside the function.
"""

from labrun.datasets import DataOptions, DatasetSplits, register_dataset

SIGNALS, LENGTH, CLASSES, MOTIF = 4000, 40, 10, 8


def motif_signals(seed: int = 0):
    """Noise with one of 10 fixed 8-value motifs added at a random position: the class."""
    import numpy as np

    rng = np.random.default_rng(seed)  # fixed: every run of a sweep sees the same signals
    motifs = rng.standard_normal((CLASSES, MOTIF))
    labels = rng.integers(0, CLASSES, SIGNALS)
    where = rng.integers(0, LENGTH - MOTIF + 1, (SIGNALS, 1)) + np.arange(MOTIF)
    signals = 0.5 * rng.standard_normal((SIGNALS, 1, LENGTH))
    signals[np.arange(SIGNALS)[:, None], 0, where] += motifs[labels]
    return signals.astype(np.float32), labels


@register_dataset("signals", help="4000 float 1-D signals (N, 1, 40), 10 classes (offline)")
def signals(options: DataOptions) -> DatasetSplits:
    return DatasetSplits(train=motif_signals())  # val and test: carved out by the library


@register_dataset("signals-shuffled", help="signals, positions shuffled by a fixed permutation")
def signals_shuffled(options: DataOptions) -> DatasetSplits:
    import numpy as np

    x, y = motif_signals()
    return DatasetSplits(train=(x[:, :, np.random.default_rng(1).permutation(LENGTH)], y))
