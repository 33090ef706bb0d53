"""The tests mirror the package: every test module sits in a folder named after a package folder
(or one of the folders for benches, GPU-only tests and the house), never loose in tests/."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN_FOLDERS = {"bench", "gpu", "package"}   # benches, CUDA-only tests, the house itself


def test_no_test_module_is_loose_in_tests():
    loose = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert not loose, f"move these into the folder of the package part they test: {loose}"


def test_every_test_folder_names_a_package_folder():
    package = {p.name for p in (REPO / "vllm_latq").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders - package <= OWN_FOLDERS, sorted(folders - package - OWN_FOLDERS)
    for folder in folders:
        assert (REPO / "tests" / folder / "__init__.py").exists(), folder
