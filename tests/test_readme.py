"""Every command in the README runs as written.

Every `python -m jaxinfer...` line of a fenced code block in README.md and docs/*.md (a leading `$ ` and a
trailing `# comment` dropped, backslash continuations joined), and every such command quoted inline, names a
module that exists, and that module's argument parser takes the command's flags as written; the values the
mesh and the engine check before JAX starts (MeshConfig, EngineConfig) pass their checks too. The cheap
commands run for real in a subprocess: the launcher's bare command on the embedded random-weight model, and
`--help` of every module the pages name. The README's two set-up commands are files that exist.
"""

import dataclasses
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import devices_of_its_own

from jaxinfer.config import EngineConfig
from jaxinfer.mesh import MeshConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`(python -m jaxinfer[^`]*)`")
# the packages run by `python -m` hand over to these modules (their __main__.py calls main() on import)
ENTRY = {"jaxinfer.bench": "jaxinfer.bench.decode", "jaxinfer.serve": "jaxinfer.serve.server",
         "jaxinfer.plan": "jaxinfer.plan.__main__"}
# placeholders in the pages' commands, and what stands in for them here
PLACEHOLDERS = {r"\$\{?\w+\}?": "dummy-key", r"(?<=[=\s])N\b": "2", r"\bURL\b": "http://127.0.0.1:8000"}


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_lines(text: str) -> list[str]:
    """The lines of every fenced code block, backslash continuations joined."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        held = ""
        for line in block.split("\n"):
            if line.rstrip().endswith("\\"):
                held += line.rstrip()[:-1] + " "
                continue
            lines.append(held + line)
            held = ""
    return lines


def collect() -> list[tuple[str, str]]:
    """(page, command) for every command the pages give, in page order, each command once."""
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        for line in fenced_lines(text):
            line = line.strip().removeprefix("$ ").strip()
            if line.startswith("python -m jaxinfer"):
                found.setdefault(line, page_name(page))
        for quoted in INLINE.findall(FENCE.sub("", text)):
            # usage notation ([--requests N]) lists optional flags: each is checked as if given
            command = re.sub(r"\s+", " ", quoted.replace("[", "").replace("]", "")).strip()
            found.setdefault(command, page_name(page))
    return [(page, command) for command, page in found.items()]


COMMANDS = collect()


def argv_of(command: str) -> tuple[str, list[str]]:
    """(module, its arguments), with the placeholders filled in and a trailing # comment dropped."""
    for pattern, value in PLACEHOLDERS.items():
        command = re.sub(pattern, value, command)
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["python", "-m"], command
    return argv[2], argv[3:]


def test_the_pages_give_commands():
    """A guard on the collection itself: the README's command-line and serving blocks are found."""
    readme = [command for page, command in COMMANDS if page == "README.md"]
    assert sum(command.startswith("python -m jaxinfer.launch ") for command in readme) >= 5, readme
    assert sum(command.startswith("python -m jaxinfer.serve") for command in readme) >= 2, readme
    assert any(page.startswith("docs") for page, _ in COMMANDS)


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[command for _, command in COMMANDS])
def test_command_parses(page, command, capsys, monkeypatch, tmp_path):
    module, args = argv_of(command)
    try:
        entry = importlib.import_module(ENTRY.get(module, module))
    except ModuleNotFoundError as e:
        pytest.fail(f"{page}: `{command}`: there is no module {module} ({e})")
    monkeypatch.chdir(ROOT)                 # the pages' paths (meshes/*.toml) are relative to the repository
    monkeypatch.setenv("OUT", str(tmp_path))  # gpu_check's output directory when none is given
    try:
        ns = entry.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{page}: `{command}` is refused by {entry.__name__}'s parser (exit {e.code}): "
                    f"{capsys.readouterr().err.strip()}")
    mesh = getattr(ns, "mesh", None)
    if mesh and mesh != "auto":             # auto: the planner's choice (tests/test_plan.py)
        try:
            MeshConfig.parse(mesh)
        except ValueError as e:
            pytest.fail(f"{page}: `{command}`: --mesh {mesh!r} is refused: {e}")
    if all(hasattr(ns, f.name) for f in dataclasses.fields(EngineConfig)):
        try:
            EngineConfig.from_cli_args(ns)
        except ValueError as e:
            pytest.fail(f"{page}: `{command}`: the engine's flags are refused: {e}")


def test_setup_commands_exist():
    """The two commands of the README's set-up are executable files at the repository root."""
    section = (ROOT / "README.md").read_text().split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    scripts = [line.split()[0] for line in fenced_lines(section) if line.startswith("./")]
    assert scripts == ["./run.sh", "./test.sh"], scripts
    for script in scripts:
        path = ROOT / script
        assert path.is_file() and os.access(path, os.X_OK), f"{script} is named in the README but not executable"


# ---- run for real ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def cache(shared_cache):
    """The run's JAXINFER_CACHE (conftest.shared_cache): the CPU kernel is there, the default model is made once."""
    return shared_cache


def run(cache: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = devices_of_its_own(os.environ)
    env |= {"JAXINFER_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}  # the launcher asks for the devices its --mesh needs
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


MODULES = sorted({argv_of(command)[0] for _, command in COMMANDS})
LAUNCH = ("jaxinfer.launch", "--max-tokens", "4")   # the launcher's bare command: the embedded random model


@pytest.fixture(scope="module")
def runs(cache) -> tuple[tuple[subprocess.CompletedProcess, ...], dict[str, subprocess.CompletedProcess]]:
    """The bare launch (--json, then as text: the second reads back the model and programs the first wrote),
    beside `python -m MODULE --help` of every module the pages name, two at a time (one per core)."""
    with ThreadPoolExecutor(3) as pool:
        launches = pool.submit(lambda: (run(cache, *LAUNCH, "--json"), run(cache, *LAUNCH)))
        helps = pool.map(lambda module: run(cache, module, "--help", timeout=120), MODULES)
        return launches.result(), dict(zip(MODULES, helps, strict=True))


def test_bare_launch_runs(runs):
    """The README's main command on the embedded random-weight model, as JSON and as text: 4 greedy tokens."""
    assert any(command.startswith("python -m jaxinfer.launch") and "--model" not in command
               for _, command in COMMANDS), "the README no longer shows the launcher on the embedded model"
    (as_json, as_text), _ = runs
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    out = json.loads(as_json.stdout)
    assert out["random_weights"] is True and "(random weights)" in out["model"]
    assert out["mesh"] == {"dp": 1, "pp": 1, "tp": 1, "ep": 1, "sp": 1}
    ids = out["output_token_ids"]
    assert len(ids) == 4 and out["finish_reason"] == "length" or 1 <= len(ids) < 4 and out["finish_reason"] == "stop"
    assert out["prompt_tokens"] > 0 and out["decode_tokens_per_second"] > 0

    assert as_text.returncode == 0, as_text.stderr[-3000:]
    assert "(random weights)" in as_text.stdout
    assert repr(out["output_text"]) in as_text.stdout              # the same greedy text as the JSON run
    assert f"{len(ids)} tokens, finish_reason={out['finish_reason']}" in as_text.stdout


@pytest.mark.parametrize("module", MODULES)
def test_help_runs(runs, module):
    r = runs[1][module]
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(f"usage: python -m {module} "), r.stdout[:200]  # its usage names the module as run
    options = set(re.findall(r"(?<![\w-])--[\w-]+", r.stdout))
    for _, command in COMMANDS:
        name, args = argv_of(command)
        if name == module:  # spelled in full: argparse would take an abbreviation, until a new flag shares it
            for flag in (a.split("=")[0] for a in args if a.startswith("--")):
                assert flag in options, f"`{command}`: {flag} is not one of `python -m {module} --help`'s flags"
