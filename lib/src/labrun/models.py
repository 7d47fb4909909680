"""The model registry (`--model`): `@register_model("name", help=...)` on a function that
returns an `nn.Module`, in any module of the project's package (lib/README.md, "Models: the
registry"; listed without torch by registry.py, so the defaults must be literals).

A model function takes what it needs of the data by name (`num_classes`, `channels`,
`image_size`, `input_shape`); its other parameters are its own size arguments: `width` from
`--width`, any other from `--model-args k=v,...`, else its default. Only those it takes (and
names in its body) go into the run's name and identity.
"""

from __future__ import annotations

import contextlib
import inspect
import math

from .registry import REQUIRED, Entry, Registry

MODELS: dict[str, Entry] = Registry("register_model")  # imports other modules on demand
# The template's models: held to deterministic CUDA kernels (no adaptive pooling) by the tests.
BUILT_IN = ("cnn", "cnn1d", "resnet18")
# What the data gives a model function (by parameter name); every other parameter is its own.
DATA_PARAMS = ("num_classes", "channels", "image_size", "input_shape")
WIDTH_DEFAULT = 64  # --width's default: the built-in models' run names depend on it


# @register_model(name, help=...) on `fn(num_classes, channels, image_size, ...) -> nn.Module`
register_model = MODELS.register


def own_arguments(declared: Entry) -> dict:
    """{name: default or REQUIRED} of a model function's own size arguments that it uses."""
    skip = {*DATA_PARAMS, *declared.unused}
    return {k: v for k, v in declared.params.items() if k not in skip}


def listed_arguments(declared: Entry) -> str:
    """The model's own arguments as --help and the refusals list them: `width, depth=2`."""
    own = own_arguments(declared)
    return ", ".join(k if v == REQUIRED else f"{k}={v!r}" for k, v in own.items())


def _typed(text: str, default, where: str):
    """--model-args text as the type of the argument's default (no default: a guess)."""
    default = None if default == REQUIRED else default
    kind = type(default) if isinstance(default, bool | int | float | str) else None
    try:
        if kind is bool or (kind is None and text.lower() in ("true", "false")):
            value = {"true": True, "false": False}[text.lower()]
        elif kind is None:  # a number where the text reads as one
            value = text
            for guess in (float, int):
                with contextlib.suppress(ValueError):
                    value = guess(text)
        else:
            value = kind(text)
    except (KeyError, ValueError):
        raise ValueError(
            f"{where}: expected a value like its default {default!r}, got {text!r}"
        ) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, got {text}")
    return value


def model_arguments(declared: Entry, width: int, given: dict) -> tuple:
    """(width or None, {other own argument: value}) for the model `declared`, from --width
    (a model without one takes only the default) and --model-args (`given`). ValueError
    (`--flag: why`) for an argument the model does not take or a required one missing."""
    own = own_arguments(declared)
    name = declared.name
    listed = listed_arguments(declared) or "none"
    if "width" in given:  # one flag for one argument
        raise ValueError("--model-args: width is set by --width; give it there")
    unknown = [k for k in given if k not in own]
    if unknown:
        raise ValueError(
            f"--model-args: model {name!r} takes no {', '.join(map(repr, unknown))}; "
            f"its own arguments: {listed}"
        )
    if "width" not in own and width != WIDTH_DEFAULT:
        raise ValueError(f"--width: model {name!r} takes no width; its arguments: {listed}")
    values = {
        key: _typed(given[key], default, f"--model-args {key}") if key in given else default
        for key, default in own.items()
        if key != "width"
    }
    missing = [key for key, value in values.items() if value == REQUIRED]
    if missing:
        raise ValueError(f"--model-args: model {name!r} needs {missing[0]}=VALUE ({listed})")
    return width if "width" in own else None, values


def create_model(
    name: str,
    *,
    num_classes: int,
    channels: int,
    image_size: tuple[int, ...],
    width: int | None = WIDTH_DEFAULT,
    input_shape: tuple[int, ...] | None = None,
    **model_args,
):
    """Build the registered model `name` for a dataset's shape and class count: the function
    gets the data's values and the size arguments it names (`width`, `model_args`)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    build = MODELS[name].build
    offered = {
        "num_classes": num_classes,
        "channels": channels,
        "image_size": tuple(image_size),
        # The data's shape per sample; a caller that gives none (a test, a notebook) means
        # channel-first data of this size, what run.py passes for signals and images.
        "input_shape": tuple(input_shape or (channels, *image_size)),
        "width": width,
        **model_args,
    }
    params = inspect.signature(build).parameters  # what it names (listing.py skips **kwargs)
    return build(**{k: v for k, v in offered.items() if k in params})
