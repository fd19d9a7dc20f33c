"""Running the kernels in Triton's interpreter, on CPU tensors (tests, debugging).

Triton decides between compiling and interpreting when a ``@triton.jit`` function is defined,
reading ``TRITON_INTERPRET`` at that moment. That covers ``triton.language``'s own helpers
(``tl.zeros``, ``tl.max``, ...), defined when ``triton`` is first imported, as well as our
kernels, defined when their module is imported. So interpretation is a per-process choice made
at import: import ``triton`` and the kernel modules inside ``triton_interpreter()``::

    with triton_interpreter():
        pytest.importorskip("triton")
        from splitserve.kernels import decode_attention

The process environment is left as it was. This module does not import triton itself.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

KERNEL_PACKAGE = "splitserve.kernels"


@contextmanager
def interpret_env() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` in ``os.environ`` for the block, restored after it."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@contextmanager
def triton_interpreter() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for the block (imports), restored after it.

    On a normal exit, checks that ``triton`` (if imported) and every imported kernel module
    are in interpreter mode, raising ``RuntimeError`` if either was first imported outside
    such a block (their functions would be compiled-only, unusable on CPU tensors).
    Launches of interpreted kernels set the variable again for their duration (Triton imports
    some modules lazily at the first launch and checks it then), see ``triton_utils.launch``.
    """
    with interpret_env():
        yield
    _check_interpreted()


def _check_interpreted() -> None:
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if isinstance(tl.zeros, JITFunction):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set: its helpers are compiled "
            "only; import triton for the first time inside triton_interpreter()"
        )
    for name, module in list(sys.modules.items()):
        if not name.startswith(KERNEL_PACKAGE + "."):
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, JITFunction):
                raise RuntimeError(
                    f"{name}.{attribute} is a compiled Triton kernel: {name} was imported "
                    "before triton_interpreter(); import it for the first time inside it"
                )
