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


@torch.no_grad()
def activations(
    model: nn.Module, batches: Iterable[torch.Tensor], names: list[str], on_batch=None
) -> dict[str, torch.Tensor]:
    """Each named layer's outputs for every input, flattened per input: {name: (n, features)}.

    Forward hooks record the layers while the model runs once per batch, in eval mode (BatchNorm
    uses its running statistics, as at test time). `on_batch()` runs after each batch (e.g. to
    honour a stop request)."""
    modules = dict(layers(model))
    out: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def hook(name):
        # A copy: a later in-place op (ReLU(inplace=True)) must not change what was recorded.
        return lambda _module, _inputs, output: out[name].append(
            output.detach().flatten(1).to("cpu", torch.float32, copy=True)
        )

    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    was_training = model.training
    model.eval()
    try:
        for x in batches:
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
