"""Test setup shared by every test module.

Without a GPU, Triton kernels run through the Triton interpreter: the variable must be set
before any kernel module is imported, because `triton.jit` decides at decoration time.
"""

import os

import pytest
import torch

from helpers.default_model import converted_default_model, first_start_first

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first_start_first(items)  # one conversion of the default model serves the session
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
    once per session: by the browser test of a first start when it ran (it runs before
    the users of this fixture), else here; needs the network (PyPI)."""
    return converted_default_model(tmp_path_factory)
