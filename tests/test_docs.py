"""The documents a user reads: the README stays short, every relative link in it and in
docs/ leads somewhere, docs/configuration.md is what `interleaf config --markdown`
writes today, and the README's job example is a valid config."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import pytest

from interleaf.coordinator.config import JobConfig, load_config
from interleaf.coordinator.config.markdown import class_doc, config_markdown, field_docs, toml_value

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _without_code(text: str) -> str:
    """A page's text less its fenced and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"(?ms)^```.*?^```", "", text))


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"(?m)^#+ (.*)$", re.sub(r"(?ms)^```.*?^```", "", page.read_text()))
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 250, f"README.md has {lines} lines: move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_maps_every_page():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing, f"README's map lacks {missing}"


def test_configuration_page_is_current():
    """The acceptance check: `interleaf config --markdown > x; cmp x docs/configuration.md`."""
    out = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "config", "--markdown"],
                         capture_output=True, cwd=ROOT, timeout=120, check=True).stdout
    assert out == config_markdown().encode()
    assert out == (ROOT / "docs" / "configuration.md").read_bytes(), (
        "docs/configuration.md is stale: run `interleaf config --markdown > docs/configuration.md`")


def test_every_field_has_a_doc_and_a_row():
    page = config_markdown()
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        assert class_doc(cls), f"{cls.__name__} needs a docstring"
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring"
            assert f"| `{section.name}.{f.name}` |" in page


def test_field_docs_read_the_string_under_each_field():
    @dataclasses.dataclass
    class Example:
        """An example."""
        a: int = 1
        """First line
        and a second."""
        b: str = "x"
        c: bool = False
        """C's."""

    assert field_docs(Example) == {"a": "First line\nand a second.", "c": "C's."}
    assert class_doc(Example) == "An example."
    assert [toml_value(v) for v in (None, True, "gpt2", (1, -1), 3e-3, 1e-8)] == [
        "unset", "true", '"gpt2"', "[1, -1]", "0.003", "1e-08"]


def test_readme_job_example_is_valid():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- job-example:[^>]*-->\n```toml\n(.*?)```", readme, re.S)
    assert block, "README lost its job example"
    config = load_config(block[1])
    assert (config.model.arch, config.parallel.world_size, config.parallel.zero) == ("llama", 4, 1)


def test_config_command_prints_a_config_that_loads_back():
    out = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "config", "--set", "train.lr=0.001",
                          "--set", "trace.steps=[0,-1]"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         check=True).stdout
    config = load_config(out)
    assert config == load_config("", ["train.lr=0.001", "trace.steps=[0,-1]"])
    assert "[metrics]" in out and "lr = 0.001" in out
