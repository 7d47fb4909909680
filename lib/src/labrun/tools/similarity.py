"""Representational similarity: a model's layers, their activations, and linear CKA.

Linear CKA (Kornblith et al. 2019, "Similarity of Neural Network Representations Revisited"):
for activations X (n x p) and Y (n x q) of the same n inputs, each column centred,

    CKA(X, Y) = ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)

It is 1 for identical representations, invariant to orthogonal transforms and isotropic scaling of
either side, but not to arbitrary invertible linear maps; it lies in [0, 1]. Computed here from the
centred Gram matrices (n x n: <K, L> / (||K|| ||L||) with K = X X^T, the same number, cheaper
when a layer has more features than there are images), in float64.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

CONTAINERS = (nn.Sequential, nn.ModuleList)


def layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's layers, in forward order: its direct children, where a Sequential of blocks
    (each itself made of modules, like ResNet's `blocks`) is opened into its blocks."""
    found: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        blocks = list(child.named_children()) if isinstance(child, CONTAINERS) else []
        if blocks and all(list(b.children()) for _, b in blocks):
            found.update((f"{name}.{sub}", block) for sub, block in blocks)
        else:
            found[name] = child
    return found


def default_layer(names: list[str]) -> str:
    """The last hidden layer: the one before the last (the classifier)."""
    return names[-2] if len(names) > 1 else names[-1]


def describe(found: dict[str, nn.Module]) -> str:
    return ", ".join(f"{name} ({type(module).__name__})" for name, module in found.items())


def choose_layer(model: nn.Module, layer: str | None, which: str) -> str:
    """`layer` of `model` (None: its last hidden layer); ValueError listing every layer."""
    found = layers(model)
    chosen = layer or default_layer(list(found))
    if chosen not in found:
        raise ValueError(f"--layer: {chosen!r} is not a layer of {which}'s model; choose one of "
                         f"{describe(found)}")  # fmt: skip
    return chosen


def test_inputs(config: dict, count: int, seed: int, batch_size: int, device, data_dir=None):
    """`count` inputs of the test split a run was tested on (rebuilt from its config.json; a
    seeded choice, in order), in batches on `device`."""
    from ..data import load_dataset, subset
    from ..loaders import Loader

    loaded = load_dataset(
        config["dataset"], data_dir or config["data_dir"], data_path=config.get("data_path"),
        image_size=tuple(config["image_size"]) if config.get("image_size") else None,
        val_fraction=config.get("val_fraction", 0.1), seed=config.get("seed", 0),
        synthetic_size=config.get("synthetic_size", 10_000), workers=0,
        data_version=config.get("data_version"), task=config.get("task", "classification"),
    )  # fmt: skip
    test = loaded.splits["test"]
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(test), generator=generator)[:count].sort().values
    loader = Loader(subset(test, chosen), batch_size, train=False, device=device, workers=0)
    return [x for x, _ in loader]


def first_tensor(output, batch: int) -> torch.Tensor:
    """What a layer's output stands for, as (batch, features): the first tensor, depth first
    (GRU and LSTM give `(output, h_n)`, MultiheadAttention `(output, weights)`), a PackedSequence
    padded, sequence-first outputs turned batch-first. ValueError when none has `batch` rows."""
    if isinstance(output, nn.utils.rnn.PackedSequence):
        output = nn.utils.rnn.pad_packed_sequence(output, batch_first=True)[0]
    elif isinstance(output, dict):
        output = next((v for v in output.values() if _holds_tensor(v)), None)
    elif isinstance(output, tuple | list):
        output = next((v for v in output if _holds_tensor(v)), None)
    if output is not None and not isinstance(output, torch.Tensor):
        return first_tensor(output, batch)
    if not isinstance(output, torch.Tensor):
        raise ValueError("its output holds no tensor")
    if output.dim() > 1 and output.shape[0] != batch and output.shape[1] == batch:
        output = output.transpose(0, 1)  # (time, batch, ...): an RNN without batch_first
    if output.dim() == 0 or output.shape[0] != batch:
        raise ValueError(f"its output {tuple(output.shape)} has no dimension of {batch} inputs")
    return output.reshape(batch, -1)


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor | nn.utils.rnn.PackedSequence):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, tuple | list) and any(_holds_tensor(v) for v in value)


@torch.no_grad()
def activations(
    model: nn.Module, batches: Iterable[torch.Tensor], names: list[str], on_batch=None
) -> dict[str, torch.Tensor]:
    """Each named layer's outputs for every input, flattened per input: {name: (n, features)},
    recorded by forward hooks in eval mode (BatchNorm's running statistics, as at test time).
    `on_batch()` runs after each batch (e.g. to honour a stop request)."""
    modules = dict(layers(model))
    out: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    batch = 0

    def hook(name):
        def record(_module, _inputs, output):
            try:
                features = first_tensor(output, batch)
            except ValueError as exc:
                raise ValueError(f"layer {name!r} ({type(_module).__name__}): {exc}") from None
            # A copy: a later in-place op (ReLU(inplace=True)) must not change what was recorded.
            out[name].append(features.detach().to("cpu", torch.float32, copy=True))

        return record

    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    was_training = model.training
    model.eval()
    try:
        for x in batches:
            batch = len(x)
            model(x)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return {name: torch.cat(parts) for name, parts in out.items()}


def centered_gram(x: torch.Tensor) -> torch.Tensor:
    """H (X X^T) H in float64, H = I - 11^T/n: the Gram matrix of X with its columns centred."""
    x = x.to(torch.float64)
    x = x - x.mean(dim=0, keepdim=True)
    return x @ x.T


def cka_from_grams(k: torch.Tensor, l: torch.Tensor) -> float:  # noqa: E741 (the paper's L)
    """<K, L>_F / (||K||_F ||L||_F) of two centred Gram matrices; nan if either is all zero."""
    denominator = torch.linalg.matrix_norm(k) * torch.linalg.matrix_norm(l)
    if denominator == 0:
        return float("nan")  # a constant representation: CKA is undefined
    return float((k * l).sum() / denominator)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two representations of the same n inputs, (n, p) and (n, q)."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs the same inputs: {x.shape[0]} vs {y.shape[0]} rows")
    return cka_from_grams(centered_gram(x), centered_gram(y))


def cka_matrix(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[list[float]]:
    """CKA of every layer of `a` (rows) with every layer of `b` (columns)."""
    grams_b = [centered_gram(y) for y in b.values()]
    rows = []
    for x in a.values():
        k = centered_gram(x)
        rows.append([cka_from_grams(k, gram) for gram in grams_b])
    return rows
