import os
import sys

import torch

# The Triton kernels run for real on CPU in the interpreter. TRITON_INTERPRET must be set
# before triton is first imported (importing torch does not import it).
if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before tests/conftest.py could enable the interpreter"
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU (interpreter)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_report_header(config):
    return (
        f"fastrl tests: torch {torch.__version__}, device={DEVICE}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"
    )
