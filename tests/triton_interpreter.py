"""Triton's interpreter made cheaper for the suite's kernel tests (TRITON_INTERPRET=1, on CPU).

Triton's interpreter patches `triton.language` for itself at each kernel launch, and again at every call of a
@triton.jit function inside the kernel (fastmae's helpers, `tl.sum`, `tl.zeros`, ...), once per program:
`inspect.getmembers` over the language modules each time, a third of an interpreted kernel's time. The launch's patch
holds until its grid ends, and a helper's patch is never undone, so a helper's call repeats work already done.
`install` skips it where the helper sees no language module that the running launch, or an earlier helper inside it,
has not patched. What the kernels compute is unchanged; the kernel tests compare every kernel with its reference.
"""

from __future__ import annotations

import functools
import inspect


def install() -> bool:
    """Wrap the interpreter's language patch as above. False, changing nothing, where Triton is absent or its
    interpreter lacks what this wraps (`_patch_lang` returning a `_LangPatchScope`, as Triton 3.9's does)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch_lang, "patches_once", False):
        return True
    languages = (interpreter.tl, interpreter.tl.core)
    running: list[set[int]] = []  # per launch whose grid runs: the language modules patched since it started

    @functools.cache
    def languages_of(fn) -> frozenset[int]:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in languages)

    def patch_once(fn):
        seen = languages_of(fn)
        if running:  # a @triton.jit function called inside a kernel: its patch would never be undone
            if seen <= running[-1]:
                return interpreter._LangPatchScope()
            running[-1] |= seen
            return patch_lang(fn)
        scope = patch_lang(fn)  # a kernel's launch: undone when its grid ends
        undo = scope.restore
        running.append(set(seen))

        def restore():
            running.pop()
            undo()

        scope.restore = restore
        return scope

    patch_once.patches_once = True
    interpreter._patch_lang = patch_once
    return True
