"""The model registry and its networks: shapes, gradients, deterministic kernels."""

import pytest
import torch
from torch import nn

from labrun.models import BUILT_IN, MODELS, create_model
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


def test_built_in_models_keep_their_size_and_use_no_adaptive_pooling():
    """The built-ins only: a model of your own may use any op (README, "Use your own model")."""
    model = build_model()
    # The CNN of the benchmarks (benchmarks/RESULTS.md): 1,941,546 parameters at width 64.
    assert sum(p.numel() for p in model.parameters()) == 1_941_546
    adaptive = (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)  # no deterministic CUDA backward
    for name in BUILT_IN:
        net = create_model(name, num_classes=3, channels=3, image_size=(64, 64), width=8)
        assert not [m for m in net.modules() if isinstance(m, adaptive)], name


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
@pytest.mark.parametrize("channels, image_size", [(1, (20, 28)), (3, (64, 64))])
def test_registered_models_adapt_to_the_data(name, channels, image_size):
    model = create_model(name, num_classes=5, channels=channels, image_size=image_size, width=8)
    x = torch.randn(2, channels, *image_size).contiguous(memory_format=torch.channels_last)
    logits = model(x)
    assert logits.shape == (2, 5)
    logits.sum().backward()


def test_help_names_match_the_registry():
    """config.py reads the @register_model lines of every module of the package without
    importing torch: they must agree with what the decorators register."""
    from labrun.registry import declarations

    declared = {name: d.help for name, d in declarations("register_model").items()}
    assert set(BUILT_IN) <= set(declared)
    assert all(name in MODELS for name in declared)  # imports the modules that declare them
    assert declared == {name: entry.help for name, entry in MODELS.items()}


def test_unknown_model_and_too_small_images_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model 'vit'"):
        create_model("vit", num_classes=2, channels=3, image_size=(32, 32), width=8)
    with pytest.raises(ValueError, match="at least 8x8"):
        create_model("cnn", num_classes=2, channels=3, image_size=(4, 4), width=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_backward_is_deterministic_on_cuda(name):
    torch.use_deterministic_algorithms(True)  # raises on any op without a deterministic kernel
    try:
        grads = []
        for _ in range(2):
            torch.manual_seed(0)
            model = create_model(
                name, num_classes=3, channels=3, image_size=(32, 32), width=8
            ).cuda()
            model(torch.randn(4, 3, 32, 32, device="cuda")).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert torch.equal(*grads)
    finally:
        torch.use_deterministic_algorithms(False)
