"""The library's size limits: no function over 60 lines but argument tables, no file over 450 lines (issue-free code
reads in one screen; a longer one is a list of steps that wants names)."""
from __future__ import annotations

import ast

import pytest

from tests.test_layers import modules

MAX_FUNCTION, MAX_FILE = 60, 450


def argument_table(node: ast.FunctionDef) -> bool:
    """A function that only adds arguments to a parser: one add_argument call after another."""
    calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    adds = sum(c.func.attr in ("add_argument", "add_argument_group", "add_mutually_exclusive_group", "add_parser")
               for c in calls)
    return adds >= len(node.body) // 2


@pytest.mark.parametrize("module", sorted(modules()))
def test_sizes(module):
    path = modules()[module]
    source = path.read_text()
    assert source.count("\n") <= MAX_FILE, f"{path}: {source.count(chr(10))} lines, more than {MAX_FILE}: split it by theme"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION
            and not argument_table(n)]
    assert not long, f"{path}: {', '.join(long)} over {MAX_FUNCTION} lines: name its steps"
