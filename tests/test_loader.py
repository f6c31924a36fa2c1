"""The native library refuses a torch it was not built for, naming both versions."""
import pytest
import torch

from hydra_torch import _loader


def test_library_matches_installed_torch():
    assert _loader.load().built_torch_version.split("+")[0] == torch.__version__.split("+")[0]


def test_version_mismatch_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "1.0.0")
    with pytest.raises(ImportError) as info:
        _loader.load()
    message = str(info.value)
    assert "1.0.0" in message and _loader.load.__module__ and "built for torch" in message
