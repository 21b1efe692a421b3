"""The embedded default corpus: English text that every CPython installation carries, so the demo runs offline.

The documentation topics of `pydoc_data` (the text behind `help('TOPIC')`) and, where the standard library ships its
sources, the docstrings of its top-level modules (read with `ast`, nothing is imported).
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def builtin_documents() -> Iterator[tuple[str, str]]:
    """(source, text) for each document, in a fixed order: about 240 documents, 1.3 MB of text."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc_data.topics[{name!r}]", topics[name]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        parts = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
        text = "\n\n".join(part for part in parts if part)
        if text:
            yield str(path), text
