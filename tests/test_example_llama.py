"""docs/data.md's "Train a Llama on your own data", run command by command as a user would:
tokenizer, prepare, a two-stage Llama job, generate, export, and transformers continuing
the prompt with the tokens `interleaf generate` chose."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _example_commands() -> list[str]:
    page = (ROOT / "docs" / "data.md").read_text()
    block = re.search(r"<!-- example: llama -->\n```sh\n(.*?)```", page, re.S)
    assert block, "docs/data.md lost its example block"
    return [line for line in block[1].splitlines() if line.strip()]


def _corpus(path: pathlib.Path) -> int:
    """Documents a user might have: the docstrings of the standard library's modules,
    classes and functions, one per line of a jsonl file."""
    docs = []
    for source in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]:
        try:
            tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        docs += [d for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and (d := ast.get_docstring(node))]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return len(docs)


def test_every_command_of_the_llama_example_runs(tmp_path):
    assert _corpus(tmp_path / "corpus.jsonl") > 1000
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "llama-tiny.toml", tmp_path / "examples")
    outputs = []
    for command in _example_commands():
        argv = shlex.split(command)
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "interleaf":
            argv = [sys.executable, "-m", "interleaf.clients.cli", *argv[1:]]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        outputs.append(done.stdout)
    assert json.loads((tmp_path / "data.bin.json").read_text())["vocab_size"] == 1024
    generated, exported = outputs[3].strip(), outputs[5].strip()
    assert generated.startswith("Return the") and len(generated) > len("Return the")
    # transformers continues the same prompt greedily with the same tokens (it stops at
    # the end-of-document token, as generate does; its text may hold the token's text).
    assert exported.startswith(generated), (generated, exported)
