"""tools/: every command-line utility is listed in the package's docstring and answers `--help` in one process."""

import importlib
import pkgutil
import re

import pytest

import tools

MODULES = sorted(m.name for m in pkgutil.iter_modules(tools.__path__))


def test_the_package_docstring_lists_every_tool_and_no_other():
    listed = re.findall(r"^- ``(\w+)``", tools.__doc__, flags=re.MULTILINE)
    assert sorted(listed) == MODULES
    assert len(MODULES) == 8


@pytest.mark.parametrize("name", [m for m in MODULES if m != "accelerate_config"])
def test_each_argparse_tool_answers_help_with_its_module_command(name, capsys):
    module = importlib.import_module(f"tools.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m tools.{name} ")
