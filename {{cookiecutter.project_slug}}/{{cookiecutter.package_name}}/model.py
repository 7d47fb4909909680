"""The default network: a small ResNet-style CNN for 32x32 images.

Shape of `build_model()` (width 64): stem 3->32 at 32x32, then three stages at 16x16 (64 ch),
8x8 (128 ch) and 4x4 (256 ch), each `maxpool -> conv-BN-ReLU -> residual block`, then a global
max-pool and a linear classifier. 1.9 M parameters; one SGD step at batch 128 takes ~0.3 s on
2 CPU cores (AVX2), so the template's tests and CPU smoke runs stay quick.
"""

from torch import nn


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
    """Max over height and width, as `amax`: unlike nn.AdaptiveMaxPool2d, its CUDA backward is
    deterministic, so --deterministic (warn_only=False) can train this model on a GPU."""

    def forward(self, x):
        return x.amax(dim=(2, 3), keepdim=True)


def stage(in_channels: int, out_channels: int) -> nn.Sequential:
    # Pool *before* the widening conv: the convs then run at half the resolution, which is what
    # keeps a step on CPU fast (pooling after the conv costs ~2x for little accuracy here).
    return nn.Sequential(
        nn.MaxPool2d(2),
        conv_bn_relu(in_channels, out_channels),
        ResidualBlock(out_channels),
    )


def build_model(num_classes: int = 10, width: int = 64) -> nn.Module:
    """Return the default network; `width` is the channel count of the first stage."""
    if width < 2:
        raise ValueError(f"width must be >= 2, got {width}")
    widths = (width, 2 * width, 4 * width)
    model = nn.Sequential(
        conv_bn_relu(3, width // 2),
        stage(width // 2, widths[0]),
        stage(widths[0], widths[1]),
        stage(widths[1], widths[2]),
        # Max rather than average pooling: it trains faster on small images (airbench's choice).
        GlobalMaxPool(),
        nn.Flatten(),
        nn.Linear(widths[2], num_classes),
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
