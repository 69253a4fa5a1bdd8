"""A non-editable install imports from outside the repository: every package and the mesh presets ship."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What the build does not need: the .gitignore'd outputs, the git directory and the tests.
IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                                ".ruff_cache", "tests")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """pip install --no-deps --target of a copy of the repo (building in the repo itself would write
    build/ and *.egg-info there while other test runs read it)."""
    tmp = tmp_path_factory.mktemp("install")
    src, target = tmp / "src", tmp / "target"
    shutil.copytree(REPO, src, ignore=IGNORE)
    # --no-build-isolation: the build uses the venv's setuptools (a test extra), so it needs no network
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-input",
           "--disable-pip-version-check"]
    r = subprocess.run([*pip, "--target", str(target), str(src)], cwd=tmp, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return target


def run_python(code: str, target: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["PYTHONPATH"] = str(target)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_installed_files(target):
    """Every source file of the package and of the folders installed inside it ships, the CPU kernel's C++
    source (compiled on first use) and the mesh presets included."""
    pkg = target / "jaxinfer"
    shipped = {"jaxinfer": "", "models": "models/", "pallas_kernels": "pallas_kernels/", "meshes": "meshes/"}
    for folder, inside in shipped.items():
        files = [f for f in (REPO / folder).rglob("*") if f.suffix in (".py", ".cc", ".h", ".toml")
                 and "__pycache__" not in f.parts]
        assert files, folder
        for f in files:
            assert (pkg / inside / f.relative_to(REPO / folder)).is_file(), f
    assert (pkg / "device" / "attention" / "paged_attention_cpu.cc").is_file()
    assert not (target / "models").exists() and not (target / "meshes").exists()    # only under jaxinfer/


def test_import_from_outside_the_repo(target, tmp_path):
    r = run_python("""
        import jaxinfer, jaxinfer.device.attention, jaxinfer.models, jaxinfer.pallas_kernels
        from jaxinfer.models import llama
        from importlib import resources
        from jaxinfer.mesh import MeshConfig
        presets = sorted(p.name for p in resources.files("jaxinfer.meshes").iterdir() if p.name.endswith(".toml"))
        assert presets, "no mesh presets were installed"
        for p in presets:
            MeshConfig.parse(p.removesuffix(".toml"))
        print(jaxinfer.__file__)
        print(jaxinfer.models.__file__)
        print(jaxinfer.pallas_kernels.__file__)
        print(llama.__file__)
        print(jaxinfer.device.attention.__file__)
        print(",".join(presets))
        assert issubclass(llama.Llama, jaxinfer.models.Model) and callable(jaxinfer.LLM)
        assert jaxinfer.models.ARCHITECTURES["LlamaForCausalLM"] is llama.Llama
        assert jaxinfer.models.ARCHITECTURES["Qwen3MoeForCausalLM"] is llama.Qwen3Moe
    """, target, tmp_path)
    assert r.returncode == 0, r.stderr
    files = r.stdout.strip().splitlines()
    assert len(files) == 6
    for f in files[:5]:
        assert Path(f).resolve().is_relative_to(target.resolve()), f
        assert not Path(f).resolve().is_relative_to(REPO), f
    assert files[-1].split(",") == sorted(p.name for p in (REPO / "meshes").glob("*.toml"))   # every preset ships


def test_installed_launcher_runs(target, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-m", "jaxinfer.launch", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--mesh" in r.stdout
    r = subprocess.run([sys.executable, "-m", "jaxinfer.launch", "--mesh", "xp=2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "xp" in r.stderr
