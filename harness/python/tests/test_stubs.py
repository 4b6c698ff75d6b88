"""The type stubs describe the extension as built: every public name and every method or
attribute of each class in `_core` is in `_core.pyi`, and nothing in the stubs is missing from
the module."""

import ast
import pathlib

import rolloutpipe
from rolloutpipe import _core

STUB = pathlib.Path(__file__).parent.parent / "python" / "rolloutpipe" / "_core.pyi"


def stub_names():
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top.add(node.name)
            names = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    names.add(item.target.id)
            members[node.name] = names
        elif isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            top.add(node.target.id)
    return top, members


def public(obj):
    return {n for n in dir(obj) if not n.startswith("_")}


def test_stubs_match_the_module():
    top, members = stub_names()
    assert top == public(_core) - {"rolloutpipe"}  # create_exception's module attribute aside
    assert set(rolloutpipe.__all__) == top
    base_exc = public(Exception)
    for name, names in members.items():
        cls = getattr(_core, name)
        have = public(cls) - base_exc
        if issubclass(cls, Exception):
            have -= {"kind"}  # set on each instance, declared on the base class
            names = names - {"kind"}
        assert have == names - {"__init__"}, name
