import pytest

from tests.gpu.cases import CUDA


@pytest.fixture(autouse=True)
def _interpreter_dry_run(monkeypatch):
    """Without CUDA (the dry run) Triton's interpreter takes the kernels' CPU tensors."""
    if not CUDA:
        monkeypatch.setenv("LATQ_TRITON_INTERPRET_OK", "1")
