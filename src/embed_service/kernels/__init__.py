"""Triton kernels for the memory-bound steps between the matmuls, installed as ``embed_service.kernels``.

Each kernel has a plain-PyTorch twin in the service's layers (layers/norm.py, layers/rotary.py,
layers/activation.py, ops/pooling.py); tests/kernels/ compares them under Triton's interpreter
(TRITON_INTERPRET=1, on a CPU) and on CUDA. Which one runs is decided once per worker in
embed_service/ops/fused.py. Importing this package needs ``triton``.

Conventions: tensors are (rows, features) with the last dimension contiguous (a row stride is taken, so
a view into a wider tensor is read in place); arithmetic is in float32, results are cast to the input's
dtype on store (pooling: float32 out).

The modules are the repository's ``kernels/`` folder, linked one by one into this package. That folder has
no ``__init__.py`` on purpose: Python run from the repository root would otherwise import it as a bare
``kernels``, the name of Hugging Face's kernels package, which transformers probes for (and then fails
to import ``PreTrainedModel``). Without one it is at most an empty namespace, which transformers ignores
and any installed ``kernels`` package outranks.
"""

from embed_service.kernels.activation import act_and_mul
from embed_service.kernels.norm import add_layer_norm, add_rms_norm
from embed_service.kernels.pooling import pool_normalize
from embed_service.kernels.rotary import rotary_

__all__ = ["act_and_mul", "add_layer_norm", "add_rms_norm", "pool_normalize", "rotary_"]
