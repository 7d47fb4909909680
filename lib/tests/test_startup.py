"""A job imports only what it needs (issue 34, "Start in seconds"): digits without
scikit-learn, and no torch._inductor from a run that neither compiles nor runs deterministic."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

from labrun import arrays


def test_digits_are_scikit_learns_split_as_before():
    """The same arrays as scikit-learn's load_digits + stratified train_test_split gave (what
    every digits run so far trained and was tested on), read without importing it."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    small = torch.from_numpy(digits.images).float().unsqueeze(1) * (255 / 16)
    big = F.interpolate(small, size=(32, 32), mode="bilinear", align_corners=False)
    images = big.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).numpy()
    train, test = train_test_split(
        np.arange(len(digits.target)), test_size=0.2, stratify=digits.target, random_state=0
    )
    decoded = arrays._decode_digits()
    for name, rows in (("train", np.sort(train)), ("test", np.sort(test))):
        assert np.array_equal(decoded[f"{name}_images"], images[rows])
        assert np.array_equal(decoded[f"{name}_labels"], digits.target[rows])


@pytest.mark.parametrize("seed", range(6))
def test_stratified_test_rows_are_train_test_splits(seed):
    """Ties in the class remainders take scikit-learn's random draws: the same ones here."""
    from sklearn.model_selection import train_test_split

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3 + seed, size=97 + 41 * seed)
    fraction = (0.1, 0.2, 0.25, 0.3, 0.5, 0.15)[seed]
    _, test = train_test_split(
        np.arange(len(labels)), test_size=fraction, stratify=labels, random_state=seed
    )
    assert np.array_equal(arrays.stratified_test_rows(labels, fraction, seed), np.sort(test))


def fresh_process(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_decoding_digits_imports_no_scikit_learn(tmp_path):
    code = (
        "import sys\n"
        "from labrun.data import load_dataset\n"
        f"splits = load_dataset('digits', {str(tmp_path)!r}).splits\n"
        "print(len(splits['test']), 'sklearn' in sys.modules)\n"
    )
    assert fresh_process(code) == "360 False"
    assert (tmp_path / arrays.DIGITS_CACHE).is_file()


def test_fast_kernels_import_no_inductor():
    code = (
        "import sys, torch\n"
        "from labrun.hardware import setup_backends\n"
        "setup_backends(torch.device('cpu'), deterministic=False)\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    assert fresh_process(code) == "False"
