# Triton must run in its interpreter (no GPU anywhere): set before anything imports triton.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def real_hessians():
    """Real layer Hessians: SmolLM2-135M (real pretrained weights) on real Wikipedia
    calibration text, for layers of its first two decoder blocks. Cached on disk."""
    from tests.real_data import real_layer_hessians
    return real_layer_hessians()
