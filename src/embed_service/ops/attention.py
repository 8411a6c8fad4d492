"""Variable-length attention over the flat token stream.

On CUDA in float16/bfloat16, one varlen kernel over the whole batch: torch's own
``torch.nn.attention.varlen.varlen_attn`` (flash attention shipped with torch) where the installed torch has
it with a ``window_size`` argument, flash-attn's ``flash_attn_varlen_func`` where that is installed and
chosen, else SDPA. On a CPU the project's own compiled kernel (ops/csrc/varlen_attention.c: no padding,
reads q/k/v through their strides) when it could be built. Elsewhere the sequences are sorted into groups
of similar length, and each group is copied into a padded (B, H, L, D) grid for torch's
scaled_dot_product_attention and copied back (the only padding this module makes).
``varlen_attention_reference`` is the plain per-sequence twin the tests compare against.

``window`` restricts each query to keys at most that many positions away (sliding-window attention, as in
ModernBERT's local layers and Mistral); with ``causal`` only the keys behind the query count.

``EMBED_ATTENTION`` picks the CUDA kernel: ``auto`` (the default: torch-varlen, else flash-attn, else
sdpa), ``torch-varlen``, ``flash-attn`` or ``sdpa``; one that is not available falls to the next in that
order.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from embed_service.ops.batch import FlatBatch, LengthGroup
from embed_service.ops.cpu_kernels import attention_kernel

try:  # optional: the `gpu` extra
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a build that does not match this torch
    flash_attn_varlen_func = None

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Backends that take the whole flat batch in one launch with no host read of cu_seqlens: what a CUDA graph
# can capture (workers/graphs.py).
VARLEN_BACKENDS = ("torch-varlen", "flash-attn")
CUDA_BACKENDS = (*VARLEN_BACKENDS, "sdpa")


def torch_varlen(module: Any = None) -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """torch's varlen_attn and the keyword arguments it takes, or None where it cannot serve here.

    Read from the function's signature, not torch's version: 2.10's takes ``is_causal`` and has no window,
    so it cannot serve the sliding-window families and is not used; from 2.11 ``window_size`` ((-1, 0) is
    causal) and later ``enable_gqa``. Without ``enable_gqa`` key/value heads still go in as they are: the
    flash kernel under it groups query heads over them itself (2.11 checks no head counts).
    """
    if module is None:
        try:
            from torch.nn.attention import varlen as module
        except Exception:  # torch < 2.10
            return None
    fn = getattr(module, "varlen_attn", None)
    if fn is None:
        return None
    try:
        params = frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if not {"window_size", "scale"} <= params:
        return None
    return fn, params


@functools.cache
def _native_varlen() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """torch_varlen() once per process, at the first CUDA decision: importing torch.nn.attention.varlen takes
    over a second, and a CPU worker never calls it."""
    return torch_varlen()


def backend_name(
    device_type: str,
    dtype: torch.dtype,
    flash_available: bool | None = None,
    torch_varlen_available: bool | None = None,
    wanted: str | None = None,
) -> str:
    """The attention kernel a worker on this device and dtype runs, as /info reports it.

    The one decision varlen_attention follows per call (a float32 call on CUDA, such as the fidelity
    check's reference pass, takes SDPA). On CUDA in float16/bfloat16: `wanted` (EMBED_ATTENTION, default
    auto) when it is available, else torch-varlen, flash-attn, sdpa in that order. On a CPU the project's
    compiled kernel when it builds; else SDPA.
    """
    wanted = wanted_backend() if wanted is None else wanted
    if device_type == "cuda" and dtype in FLASH_DTYPES:
        flash = flash_attn_varlen_func is not None if flash_available is None else flash_available
        native = _native_varlen() is not None if torch_varlen_available is None else torch_varlen_available
        available = {"torch-varlen": native, "flash-attn": flash, "sdpa": True}
        order = [wanted] if wanted != "auto" else []
        return next(b for b in [*order, *CUDA_BACKENDS] if available[b])
    if device_type == "cpu" and attention_kernel() is not None:
        return "cpu-kernel"
    return "sdpa"


def wanted_backend() -> str:
    """EMBED_ATTENTION: auto, torch-varlen, flash-attn or sdpa."""
    mode = os.environ.get("EMBED_ATTENTION", "auto").strip().lower() or "auto"
    if mode not in ("auto", *CUDA_BACKENDS):
        raise ValueError(f"EMBED_ATTENTION={mode!r}: expected auto, {', '.join(CUDA_BACKENDS)}")
    return mode


def window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """(left, right) keys around the query, as both varlen kernels take it: (w, 0) when causal (no key
    ahead of the query), (w, w) for a bidirectional local layer, (-1, 0) causal, (-1, -1) no limit."""
    if window is None:
        return (-1, 0) if causal else (-1, -1)
    return (window, 0 if causal else window)


def torch_varlen_args(
    q: torch.Tensor,
    k: torch.Tensor,
    batch: FlatBatch,
    causal: bool,
    scale: float,
    window: int | None,
    params: frozenset[str],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """varlen_attn's arguments past q, k, v: (cu_seq_q, cu_seq_k, max_q, max_k) and the keywords that
    `params` (its signature) takes. cu_seqlens go in as int32, the max lengths as Python ints (a CUDA
    graph replays them fixed); causality and the window as one window_size tuple; GQA by enable_gqa
    where the function has it, the key/value heads as they are either way."""
    cu = batch.cu_seqlens if batch.cu_seqlens.dtype == torch.int32 else batch.cu_seqlens.to(torch.int32)
    kwargs: dict[str, Any] = {"scale": scale, "window_size": window_size(causal, window)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return (cu, cu, int(batch.max_seqlen), int(batch.max_seqlen)), kwargs


def flash_varlen_kwargs(
    batch: FlatBatch, causal: bool, scale: float, window: int | None
) -> dict[str, object]:
    """flash_attn_varlen_func's arguments past q, k, v for one flat batch.

    k and v go in with their own (fewer) heads: flash-attn groups query heads over them itself, so GQA
    repeats nothing. A sliding window is (left, right) keys around the query: (w, 0) when causal (no key
    ahead of the query), (w, w) for a bidirectional local layer; (-1, -1) is no window.
    """
    return {
        "cu_seqlens_q": batch.cu_seqlens,
        "cu_seqlens_k": batch.cu_seqlens,
        "max_seqlen_q": batch.max_seqlen,
        "max_seqlen_k": batch.max_seqlen,
        "softmax_scale": scale,
        "causal": causal,
        "window_size": (-1, -1) if window is None else window_size(causal, window),
    }


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: FlatBatch,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) with Hq a multiple of Hkv -> (T, Hq, D).

    window: keys farther than this from the query (|i - j| > window) are masked; None for no limit.
    backend: a CUDA kernel by name (CUDA_BACKENDS; benchmarks compare them); None: this process's choice.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if window is not None and window >= batch.max_seqlen - 1:
        window = None  # the window covers every sequence of this batch
    if q.is_cuda and q.dtype in FLASH_DTYPES:
        chosen = backend or _cuda_backend()
        native = _native_varlen() if chosen == "torch-varlen" else None
        if native is not None:
            fn, params = native
            args, kwargs = torch_varlen_args(q, k, batch, causal, scale, window, params)
            return fn(q, k, v, *args, **kwargs)
        if chosen == "flash-attn" and flash_attn_varlen_func is not None:
            return flash_attn_varlen_func(q, k, v, **flash_varlen_kwargs(batch, causal, scale, window))
    kernel = attention_kernel() if q.device.type == "cpu" else None
    if kernel is not None and kernel.supports(q, k, v):
        return kernel(q, k, v, batch.cu_seqlens, batch.max_seqlen, causal, scale, window)
    return varlen_attention_torch(q, k, v, batch, causal, scale, window)


_CUDA_CHOICE: str | None = None


def _cuda_backend() -> str:
    """This process's CUDA choice (backend_name), decided at the first call."""
    global _CUDA_CHOICE
    if _CUDA_CHOICE is None:
        _CUDA_CHOICE = backend_name("cuda", torch.bfloat16)
    return _CUDA_CHOICE


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: FlatBatch,
    causal: bool,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The torch-only path: length groups padded into grids for scaled_dot_product_attention."""
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for group in batch.attention_groups(GROUP_RATIO):
        _attend_group(q, k, v, out, group, causal, scale, gqa, window)
    return out


# A new group starts when a sequence is shorter than this fraction of the group's longest one, so the
# padded grid of a group holds at most ~1 / GROUP_RATIO**2 times the attention work of its real tokens.
GROUP_RATIO = 0.7


def _attend_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    group: LengthGroup,
    causal: bool,
    scale: float,
    gqa: bool,
    window: int | None,
) -> None:
    """Attention over one group of similar-length sequences, written into `out` (T, Hq, D) in place.

    Why groups: torch's CPU SDPA kernel costs ~B * L_max**2, and a batch mixing 20- and 256-token inputs
    would pay 256**2 for every one of them. Why slices rather than index_put/gather: the sequences are
    contiguous runs of the flat stream, so padding is B memcpys (pad_sequence) instead of a scatter over a
    zero-filled (B * L) grid, which cost as much as the attention itself.
    """
    spans = group.spans
    if len(spans) == 1 and window is None:  # (1, H, n, D): no padding, no mask
        s, e = spans[0]
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None],
            k[s:e].transpose(0, 1)[None],
            v[s:e].transpose(0, 1)[None],
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        out[s:e] = o[0].transpose(0, 1)
        return

    def grid(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (B, H, L, D), zeros past each length
        return pad_sequence([x[s:e] for s, e in spans], batch_first=True).transpose(1, 2)

    mask = group.key_valid  # (B, 1, 1, L) or None when every sequence has length L
    if causal or window is not None:
        allowed = _allowed(group.max_len, causal, window, q.device)
        mask = allowed if mask is None else mask & allowed
    o = F.scaled_dot_product_attention(
        grid(q), grid(k), grid(v), attn_mask=mask, scale=scale, enable_gqa=gqa
    ).transpose(1, 2)  # (B, L, H, D)
    # Back to the flat stream in two ops, not one copy per sequence: the real rows in (sequence, position)
    # order, then into their places.
    rows = o.reshape(-1, o.shape[2], o.shape[3]) if group.key_valid is None else o[group.key_valid[:, 0, 0]]
    out.index_copy_(0, group.token_index, rows)


def _allowed(n: int, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """(n, n) bool: may query i attend to key j."""
    offset = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]  # i - j
    allowed = offset >= 0 if causal else torch.ones(n, n, dtype=torch.bool, device=device)
    if window is not None:
        allowed = allowed & (offset.abs() <= window)
    return allowed


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence at a time, softmax written out, in float32."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs = q[s:e].float().transpose(0, 1)  # (H, n, D)
        ks = k[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[s:e].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale  # (H, n, n)
        if causal or window is not None:
            scores = scores.masked_fill(~_allowed(e - s, causal, window, scores.device), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out
