"""Triton's interpreter for the kernel tests (tests/kernels/), switched on before any test module loads.

Triton reads TRITON_INTERPRET when it is first imported (its own library functions are decorated then),
and a test module may import it early (sentence-transformers does through torch._dynamo), so the root
conftest imports this module first. The variable is then taken out of the environment, and the interpreter
stays on in this process through triton's knob, so the servers the tests start do not inherit it.
TRITON_INTERPRET=0 set by the caller leaves triton compiling (the kernel tests then run on CUDA:
benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import os

ENABLED = False

if os.environ.get("TRITON_INTERPRET") != "0":
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        from triton import knobs

        knobs.runtime.interpret = True
        ENABLED = True
    except ImportError:  # no triton: tests/kernels/ skip, saying so
        pass
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
