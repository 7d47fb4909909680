"""The models (`--model`). A model is one decorated function:

    @register_model("mlp", help="a perceptron with `depth` hidden layers")
    def mlp(num_classes: int, input_shape: tuple, width: int, depth: int = 1):
        layers, size = [nn.Flatten()], math.prod(input_shape)
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        return nn.Sequential(*layers, nn.Linear(size, num_classes))

It takes what it needs of the data by name (num_classes, channels, image_size, input_shape);
its other parameters are its own size arguments: `width` from --width (64), the rest from
`--model-args depth=2,...` or their defaults. Run names and tables show only those it takes.

A model may also live in another module of the package (`mymodels.py`, `models/unet.py`),
and be registered by a call (`register_model(name, help=...)(fn)`, in a loop as well). `--help`
lists them without importing torch (labrun's registry: once per edit, in a child process); the
defaults must be literals. The module is imported when a run asks for one of its models.

The default, `cnn` = `build_model()` (width 64, 3x32x32 input): stem 3->32 at 32x32, then three
stages at 16x16 (64 ch), 8x8 (128 ch) and 4x4 (256 ch), each `maxpool -> conv-BN-ReLU -> residual
block`, then a global max-pool and a linear classifier. 1.9 M parameters; one SGD step at batch
128 takes ~0.3 s on 2 CPU cores (AVX2), so the template's tests and CPU smoke runs stay quick.
Any channel count and image size (>= 8x8) work: the global pool removes the spatial size.
Every op of the built-in models has a deterministic CUDA kernel (no adaptive pooling), so
--deterministic runs (tests/test_model.py holds the built-ins to that; a model of your own may use
any op, and --deterministic then raises if one has no deterministic kernel).
"""

from __future__ import annotations

from collections import OrderedDict

from labrun.models import register_model
from torch import nn


def named(*layers: tuple[str, nn.Module]) -> nn.Sequential:
    """A Sequential of named layers (analyze.py's tables and figures show the names). It still
    loads the weights of runs saved when its layers were numbered ("0.0.weight": runs of the
    template before the names), so they resume and are analysed as before."""
    model, names = nn.Sequential(OrderedDict(layers)), [name for name, _ in layers]

    def numbered(module, state: dict, prefix: str, *_) -> None:
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix)].isdigit()]:
            index, _, rest = key[len(prefix) :].partition(".")
            state[f"{prefix}{names[int(index)]}.{rest}"] = state.pop(key)

    model.register_load_state_dict_pre_hook(numbered)
    return model


def conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        # No conv bias: the BatchNorm right after subtracts the mean, a bias would be dead weight.
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class ResidualBlock(nn.Module):
    """Two 3x3 convs with an identity shortcut (ResNet's basic block, same width in and out)."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(
            conv_bn_relu(channels, channels),
            nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x + self.body(x))


class GlobalMaxPool(nn.Module):
    """Max over height and width (or length), as `amax`: unlike nn.AdaptiveMaxPool2d, its CUDA
    backward is deterministic, so --deterministic (warn_only=False) can train it on a GPU."""

    def forward(self, x):
        return x.amax(dim=tuple(range(2, x.ndim)), keepdim=True)


def stage(in_channels: int, out_channels: int) -> nn.Sequential:
    # Pool *before* the widening conv: the convs then run at half the resolution, which is what
    # keeps a step on CPU fast (pooling after the conv costs ~2x for little accuracy here).
    return nn.Sequential(
        nn.MaxPool2d(2),
        conv_bn_relu(in_channels, out_channels),
        ResidualBlock(out_channels),
    )


def build_model(num_classes: int = 10, width: int = 64, *, channels: int = 3) -> nn.Module:
    """Return the default network; `width` is the channel count of the first stage."""
    if width < 2:
        raise ValueError(f"--width: must be >= 2 (the stem has width // 2 channels), got {width}")
    widths = (width, 2 * width, 4 * width)
    model = named(
        ("stem", conv_bn_relu(channels, width // 2)),
        ("stage1", stage(width // 2, widths[0])),
        ("stage2", stage(widths[0], widths[1])),
        ("stage3", stage(widths[1], widths[2])),
        # Max rather than average pooling: it trains faster on small images (airbench's choice).
        ("pool", GlobalMaxPool()),
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(widths[2], num_classes)),
    )
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    # Zero the last BN of each residual branch so every block starts as the identity: the usual
    # ResNet trick (Goyal et al. 2017) that makes the first epochs stable at large learning rates.
    for module in model.modules():
        if isinstance(module, ResidualBlock):
            nn.init.zeros_(module.body[-1].weight)
    return model


@register_model("cnn", help="small ResNet-style CNN for small images (the default)")
def cnn(num_classes: int, channels: int, image_size: tuple[int, int], width: int) -> nn.Module:
    if len(image_size) != 2 or min(image_size) < 8:
        raise ValueError(
            "--model cnn: needs images (N, C, H, W) of at least 8x8 (three 2x poolings), "
            f"got {'x'.join(map(str, image_size)) or 'vectors'}"
        )
    return build_model(num_classes, width, channels=channels)


@register_model("cnn1d", help="small 1-D CNN for signals (N, C, L)")
def cnn1d(num_classes: int, channels: int, width: int, depth: int = 2, kernel: int = 5):
    """`depth` conv-BN-ReLU layers of `width` channels, a global max over the length, a linear
    classifier: it finds a pattern wherever it sits in the signal."""
    layers = []
    for i in range(1, depth + 1):
        layers += [  # no conv bias: the BatchNorm right after subtracts the mean
            (
                f"conv{i}",
                nn.Conv1d(
                    width if i > 1 else channels, width, kernel, padding=kernel // 2, bias=False
                ),
            ),  # fmt: skip
            (f"bn{i}", nn.BatchNorm1d(width)),
            (f"relu{i}", nn.ReLU(inplace=True)),
        ]
    pool = [("pool", GlobalMaxPool()), ("flatten", nn.Flatten())]
    return named(*layers, *pool, ("fc", nn.Linear(width, num_classes)))


# --------------------------------------------------------------------------------------------
# ResNet-18 (He et al. 2016), written out: a starting point for larger images.


class BasicBlock(nn.Module):
    """ResNet's basic block; a strided 1x1 conv shortcut where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """Four stages of two basic blocks (width, 2x, 4x, 8x channels), global average pool.

    Images of 64 px and more get ImageNet's stem (7x7 stride 2 + max-pool: 4x less compute in
    every stage); smaller ones CIFAR's 3x3 stem, which keeps their little resolution.
    """

    def __init__(
        self, num_classes: int, channels: int, image_size: tuple[int, int], width: int = 64
    ):
        super().__init__()
        if min(image_size) >= 64:
            self.stem = nn.Sequential(
                nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(channels, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            )
        blocks, in_channels = [], width
        for i, out_channels in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if i == 0 else 2
            blocks += [
                BasicBlock(in_channels, out_channels, stride),
                BasicBlock(out_channels, out_channels, 1),
            ]
            in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if isinstance(module, BasicBlock):  # each block starts as (almost) the identity
                nn.init.zeros_(module.body[-1].weight)

    def forward(self, x):
        # mean, not nn.AdaptiveAvgPool2d: the latter's CUDA backward is not deterministic.
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


@register_model("resnet18", help="ResNet-18 (11 M parameters at width 64) for larger images")
def resnet18(num_classes: int, channels: int, image_size: tuple[int, int], width: int) -> nn.Module:
    if len(image_size) != 2:
        raise ValueError("--model resnet18: needs images (N, C, H, W); try cnn1d for signals")
    return ResNet18(num_classes, channels, image_size, width)
