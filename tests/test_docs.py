"""What a user reads: the README is a front page whose links lead somewhere, the documentation names
tests and modules that exist, and ``effitrain --help`` is plain text (the site itself is built by
``mkdocs build --strict`` in .ci/run)."""

from __future__ import annotations

import re

import pytest

from effitrain.cli import main
from tests.helpers.run import REPO

PAGES = sorted((REPO / "docs").glob("*.md"))
# reStructuredText a terminal shows as it is: ``literal``, :mod:`x`, :func:`x`, :class:`x`
RST = re.compile(r"``|:(?:mod|func|class|meth|data):`")


def test_the_readme_is_a_front_page_whose_links_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert "docs/index.md" in links
    assert [link for link in links if not (REPO / link).exists()] == []


def test_every_page_is_in_the_site_and_names_files_that_exist():
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == [page.name for page in PAGES]
    missing = []
    for page in PAGES:
        text = page.read_text()
        for path, name in re.findall(
            r"`((?:effitrain|tests|benchmarks|conf)/[\w/.-]+\.(?:py|md|yaml))(?:::(\w+))?", text
        ):
            if not (REPO / path).exists():
                missing.append(f"{page.name}: {path}")
            elif name and f"def {name}(" not in (REPO / path).read_text():
                missing.append(f"{page.name}: {path}::{name}")
    assert missing == []


@pytest.mark.parametrize("command", [[], ["check"], ["compare"], ["estimate"], ["plan"], ["export"]])
def test_help_is_plain_text_that_says_what_the_command_does(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert exited.value.code == 0
    assert RST.findall(text) == []
    assert "without weights" not in text  # estimate predicts a run with weights; it loads none
    # a description between the usage line and the arguments
    usage, description = text.split("\n\n")[:2]
    assert usage.startswith("usage: effitrain") and not description.startswith(("positional", "options"))
    assert len(description.split()) >= 8
