"""The model registry (`--model`): `@register_model("name", help=...)` on a function
`fn(num_classes, channels, image_size, width) -> nn.Module` in any module of the project's
package. The names and help texts are read from the source without importing it (registry.py),
so `--help` needs no torch: write them as plain string literals. The module is imported when a
run asks for one of its models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .registry import Registry

MODELS: dict[str, ModelEntry] = Registry("register_model")  # imports other modules on demand
# The template's models: held to deterministic CUDA kernels (no adaptive pooling) by the tests.
BUILT_IN = ("cnn", "resnet18")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    build: Callable
    help: str


def register_model(name: str, *, help: str = ""):
    """Decorator: register `fn(num_classes, channels, image_size, width) -> nn.Module`."""

    def add(fn):
        MODELS.add(name, ModelEntry(name, fn, help))
        return fn

    return add


def create_model(
    name: str, *, num_classes: int, channels: int, image_size: tuple[int, int], width: int
):
    """Build the registered model `name` for a dataset's shape and class count."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name].build(
        num_classes=num_classes, channels=channels, image_size=tuple(image_size), width=width
    )
