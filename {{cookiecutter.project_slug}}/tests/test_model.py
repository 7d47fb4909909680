"""The default network: shapes, gradients, and the no-bias-before-BatchNorm rule."""

import torch
from torch import nn

from {{ cookiecutter.package_name }}.model import build_model


def test_default_model_forward_backward():
    model = build_model()
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    logits = model(x)
    assert logits.shape == (4, 10)
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_width_and_classes():
    model = build_model(num_classes=3, width=16)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)
    small = sum(p.numel() for p in model.parameters())
    assert small < sum(p.numel() for p in build_model().parameters())


def test_no_conv_bias_before_batchnorm():
    modules = list(build_model().modules())
    convs = [m for m in modules if isinstance(m, nn.Conv2d)]
    assert convs and all(conv.bias is None for conv in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in modules) == len(convs)


def test_residual_blocks_start_as_identity():
    model = build_model().eval()
    from {{ cookiecutter.package_name }}.model import ResidualBlock

    block = next(m for m in model.modules() if isinstance(m, ResidualBlock))
    x = torch.rand(2, block.body[-1].num_features, 8, 8)  # non-negative: unchanged by ReLU
    torch.testing.assert_close(block(x), x)
