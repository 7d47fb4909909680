"""This project's networks: shapes, gradients, size, deterministic kernels."""

import pytest
import torch
from labrun.models import BUILT_IN, create_model
from labrun.registry import declarations
from torch import nn

from {{ cookiecutter.package_name }}.model import ResidualBlock, build_model


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
    block = next(m for m in build_model().eval().modules() if isinstance(m, ResidualBlock))
    x = torch.rand(2, block.body[-1].num_features, 8, 8)  # non-negative: unchanged by ReLU
    torch.testing.assert_close(block(x), x)


MODELS = sorted(declarations("register_model"))  # every --model of this project
SIGNAL_MODELS = ("cnn1d",)  # they take signals (N, C, L); every other one images (N, C, H, W)


def sample(name, batch, channels, image_size, **kwargs):
    """A random input of the kind model `name` takes: images, or signals of the last length."""
    size = image_size[-1:] if name in SIGNAL_MODELS else image_size
    return torch.randn(batch, channels, *size, **kwargs), size


def test_built_in_models_use_no_adaptive_pooling():
    """--deterministic: adaptive pooling has no deterministic CUDA backward. The template's
    models only: a model of your own may use any op (README, "Use your own model")."""
    adaptive = (nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)
    for name in BUILT_IN:
        size = sample(name, 1, 3, (64, 64))[1]
        net = create_model(name, num_classes=3, channels=3, image_size=size, width=8)
        assert not [m for m in net.modules() if isinstance(m, adaptive)], name


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("channels, image_size", [(1, (20, 28)), (3, (64, 64))])
def test_registered_models_adapt_to_the_data(name, channels, image_size):
    x, size = sample(name, 2, channels, image_size)
    model = create_model(name, num_classes=5, channels=channels, image_size=size, width=8)
    if x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    logits = model(x)
    assert logits.shape == (2, 5)
    logits.sum().backward()


@pytest.mark.parametrize("name", ["cnn", "cnn1d"])
def test_weights_saved_with_numbered_layers_still_load(name):
    """Runs saved before the layers had names ("0.0.weight", now "stem.0.weight") resume and are
    analysed as before: the same weights give the same outputs."""
    x, size = sample(name, 2, 2, (16, 16))
    make = lambda: create_model(name, num_classes=3, channels=2, image_size=size, width=8).eval()  # noqa: E731
    saved, model = make(), make()
    names = [n for n, _ in saved.named_children()]
    assert not any(n.isdigit() for n in names)  # analyze.py shows these names
    numbered = {f"{names.index(k.split('.')[0])}.{k.partition('.')[2]}": v
                for k, v in saved.state_dict().items()}  # fmt: skip
    model.load_state_dict(numbered)  # strict: every key found
    torch.testing.assert_close(model(x), saved(x))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BUILT_IN)
def test_backward_is_deterministic_on_cuda(name):
    torch.use_deterministic_algorithms(True)  # raises on any op without a deterministic kernel
    try:
        grads = []
        for _ in range(2):
            torch.manual_seed(0)
            x, size = sample(name, 4, 3, (32, 32), device="cuda")
            model = create_model(name, num_classes=3, channels=3, image_size=size, width=8)
            model.cuda()(x).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert torch.equal(*grads)
    finally:
        torch.use_deterministic_algorithms(False)
