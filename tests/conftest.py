# Triton must run in its interpreter (no GPU anywhere): set before anything imports triton.
import os
import shutil

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import gemv_isa_set  # noqa: E402
from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model  # noqa: E402

# pytest-xdist workers (scripts/test.sh) share the cores: each gets its share, at most 2 threads, unless the
# run was given OMP_NUM_THREADS (beside other work: more threads than idle cores wait for each other). The
# commands and processes under test get the same count: not fitted to the load (vllm_latq/threads.py), which
# would make a checkpoint's last bits depend on what else runs. The given count is kept apart because the
# controller's own setting below reaches its workers.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_GIVEN = os.environ.setdefault("LATQ_TESTS_GIVEN_THREADS", os.environ.get("OMP_NUM_THREADS", ""))
torch.set_num_threads(int(_GIVEN) if _GIVEN else max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test ends with the environment it began with: a command under test sets variables for the
    processes it starts (latq-serve its pinned digest), which would change what later tests run under."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="session")
def real_hessians():
    """Real layer Hessians: SmolLM2-135M (real pretrained weights) on real Wikipedia
    calibration text, for layers of its first two decoder blocks. Cached on disk."""
    from vllm_latq.testing.hessians import real_layer_hessians
    return real_layer_hessians()


def _shared(tmp_path_factory, name: str):
    """(a folder all of this run's pytest-xdist workers share, its lock): what one worker builds there
    the others read (read-only) instead of building it again on the same cores."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return root / name, FileLock(str(root / f".{name}.lock"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    d, lock = _shared(tmp_path_factory, "shared-tiny-llama")
    with lock:
        if not (d / "done").exists():
            shutil.rmtree(d, ignore_errors=True)
            make_tiny_model(d / "llama", "llama")
            (d / "done").touch()
    return d / "llama"


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_llama, tmp_path_factory):
    """{method: (checkpoint dir, {layer: QuantResult})} for SSQR and HPTQ of the tiny Llama, built once
    for all workers (tests copy a checkpoint before they edit it: ``ck``, ``pair``)."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    root, lock = _shared(tmp_path_factory, "shared-ckpt")
    out = {}
    with lock:
        for method in ("ssqr", "hptq"):
            if not (root / f"{method}.results").exists():
                results = {}
                shutil.rmtree(root / method, ignore_errors=True)
                quantize_model(tiny_llama, root / method, QuantizeOptions(method=method, **TINY_OPTS), progress=False,
                               on_layer=lambda name, W, H, res, r=results: r.__setitem__(name, res))
                torch.save(results, root / f"{method}.results")
            out[method] = (root / method, torch.load(root / f"{method}.results", weights_only=False))
    return out


@pytest.fixture
def ck(tiny_checkpoints, tmp_path):
    """A copy of the tiny SSQR checkpoint that a test may edit (the session's original stays intact)."""
    d = tmp_path / "ck"
    shutil.copytree(tiny_checkpoints["ssqr"][0], d)
    return d


@pytest.fixture
def pair(tiny_checkpoints, tmp_path):
    """(A, B, A's digest, B's digest): copies of two sealed checkpoints of one model (SSQR, HPTQ), which a
    test may swap (the readers' pin tests)."""
    from vllm_latq.format.manifest import digest_of
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_checkpoints["ssqr"][0], a)
    shutil.copytree(tiny_checkpoints["hptq"][0], b)
    return a, b, digest_of(a), digest_of(b)


@pytest.fixture
def native_ops():
    """Skips the test where the package's C++ ops cannot be built; built at the first test that asks,
    not while the tests are collected (collection takes seconds)."""
    from vllm_latq import native
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")


@pytest.fixture(params=["avx512", "avx2"])
def gemv_isa(request):
    """Each instruction set the C++ GEMV can run on here, set for the test (:func:`gemv_isa_set`)."""
    with gemv_isa_set(request.param) as isa:
        yield isa
