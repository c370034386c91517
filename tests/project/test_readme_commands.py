"""Every command in the README runs as written after the two set-up commands (issue 25).

The README's fenced shell blocks are read, each command is run in its `--help` form from a
copy of the checkout as a fresh clone has it (the committed and to-be-committed files, with
the virtual environment that `bash setup.sh` makes: the packages of the one running the tests,
and the copy installed into it, editable, with its commands), and every flag the command uses
must be one its `--help` lists. Python blocks must compile. Commands in the prose must not call a
bare `python`, which is not the one with Kestrel's dependencies.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers.checkout import console_scripts, copy_checkout, layered_venv, pip_offline

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")


def blocks(language: set[str]) -> list[str]:
    return [m[2] for m in FENCE.finditer(README.read_text("utf-8")) if m[1] in language]


def shell_commands() -> list[list[str]]:
    """Each command of the README's shell blocks as argv (comments, line continuations,
    `&&` chains and leading VAR=value assignments handled as the shell would)."""
    commands = []
    for block in blocks({"bash", "sh", "shell"}):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                command, words = words[:cut], words[cut + 1 :]
                while command and re.match(r"^[A-Z_][A-Z0-9_]*=", command[0]):
                    command = command[1:]
                if command:
                    commands.append(command)
    return commands


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout's files as a fresh clone has them, plus setup.sh's .venv."""
    target = copy_checkout(tmp_path_factory.mktemp("clone"))
    pip_offline(layered_venv(target / ".venv"), "install", "-e", str(target))
    return target


COMMANDS = shell_commands()
SCRIPTS = console_scripts()


def test_the_readme_has_commands() -> None:
    starts = {" ".join(c[:2]) for c in COMMANDS}
    assert {"bash setup.sh", ".venv/bin/python ui.py"} <= starts


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c)[:60] for c in COMMANDS])
def test_command_runs_as_written(command: list[str], clone: Path) -> None:
    if command[:2] == ["bash", "setup.sh"]:
        # The one command not run here (it installs); it must exist and parse.
        assert subprocess.run(["bash", "-n", "setup.sh"], cwd=clone).returncode == 0
        return
    if command[0] == "pip":
        # The TGW section's commands run in TGW's own environment: tests/
        # test_tgw_requirements.py resolves this very command against TGW's pins.
        assert command[1] in ("install", "uninstall"), shlex.join(command)
        return
    if command[0] in SCRIPTS:
        # A console script as TGW's environment has it after `pip install /path/to/kestrel`
        # (pyproject.toml [project.scripts]); setup.sh put the same into .venv/bin.
        _check_help(command, clone, run=[f".venv/bin/{command[0]}", *command[1:]])
        return
    if command[0] == ".venv/bin/torchrun":
        # torchrun's own flags, then the module it starts on every rank with the rest.
        split = command.index("-m")
        _check_help(command[:split], clone)
        _check_help([".venv/bin/python", *command[split:]], clone)
        return
    runnable = [".venv/bin/python", *(f".venv/bin/{name}" for name in SCRIPTS)]
    assert command[0] in runnable, f"not runnable after set-up: {shlex.join(command)}"
    _check_help(command, clone)


def _check_help(command: list[str], clone: Path, run: list[str] | None = None) -> None:
    """`command --help` runs (as `run` where given: the same program by another way in),
    and lists every flag the command gives."""
    # argparse prints the help of the (sub)command reached and exits 0 at --help.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    argv = [*(run or command), "--help"]
    result = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{shlex.join(command)} --help:\n{result.stderr[-2000:]}"
    # Flags the command gives must be ones the program has (argparse would refuse the rest
    # only after --help had already ended the run).
    for word in command[1:]:
        if FLAG.match(word) and word != "-m":
            assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", result.stdout), (
                f"{shlex.join(command)}: {word} is not among the flags of its --help"
            )


@pytest.mark.parametrize("index", range(len(blocks({"python"}))))
def test_python_block_compiles(index: int) -> None:
    compile(blocks({"python"})[index], f"README python block {index}", "exec")


def test_prose_commands_use_the_venv() -> None:
    text = README.read_text("utf-8")
    bare = re.findall(r"(?<![/\w])python3? (?:-m |[\w/]+\.py)", text)
    assert not bare, f"commands with a bare python (use .venv/bin/python): {bare}"


def test_relative_links_exist() -> None:
    for target in re.findall(r"\]\(([^)#:]+)\)", README.read_text("utf-8")):
        assert (ROOT / target).exists(), target
