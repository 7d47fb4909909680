"""The model registry: names read without torch, imported on demand, clear errors."""

import pytest

from labrun.models import BUILT_IN, MODELS, create_model


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
