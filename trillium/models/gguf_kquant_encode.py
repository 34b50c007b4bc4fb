"""Encode float32 weights as GGUF Q4_K / Q5_K / Q6_K super-blocks (for tests and benchmarks).

    quantize(w [rows, K] float32, ggml_type) -> uint8 [rows, K / 256 * block bytes]
    TYPES: the ggml type ids handled here

WHY here: gguf-py (gguf.quants) decodes the K-quants but raises
NotImplementedError when asked to encode them, and llama.cpp's own encoder is
C (`llama-quantize`). Tests and `bench/` need K-quant files built on the spot
(nothing is downloaded), so this writes the exact byte layout of ggml's
`block_q4_K` / `block_q5_K` / `block_q6_K` (ggml/src/ggml-common.h), packed as
ggml/src/ggml-quants.c `quantize_row_q{4,5,6}_K_ref` packs them, and
`gguf.quants.dequantize` reads the result back (tests check the round trip).

NOTE: the values are a plain round-to-nearest fit (per 32-input sub-block:
min and range for Q4_K / Q5_K, max |w| for each 16-input Q6_K group; the
super-block scales are the largest sub-block scale over 63 / 127), not
llama.cpp's iterative `make_qkx2_quants` search, so the error is somewhat
larger than a llama.cpp-made file's. The layout, and hence what a decoder
reads, is the same. Nothing in serving uses this module.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256
Q4_K, Q5_K, Q6_K = (int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q5_K),
                    int(GGMLQuantizationType.Q6_K))  # fmt: skip
TYPES = frozenset((Q4_K, Q5_K, Q6_K))


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 values, their float32 widening) of x."""
    h = x.astype(np.float16)
    return h, h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a, dtype=np.float32), where=b != 0)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [n, 8] -> the 12 bytes get_scale_min_k4 unpacks [n, 12]."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _type1(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K fit of super-blocks x [n, 256]: (d, dmin fp16 [n], scales bytes [n, 12], q [n, 256])."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # ggml's type-1 mins are <= 0 (stored as a positive m)
    scale = (sub.max(-1) - lo) / levels
    d_h, d = _fp16(scale.max(-1) / 63)
    dmin_h, dmin = _fp16((-lo).max(-1) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc  # what the decoder multiplies by (exact in float32)
    offset = dmin[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d_h, dmin_h, _pack_scales(sc, m), q.reshape(-1, QK_K)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 256] (low 4 bits used) -> qs [n, 128]: byte 32p + l = q[64p + l] | q[64p + 32 + l] << 4."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _type1(x, 15)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, _nibbles(q)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _type1(x, 31)
    high = (q.reshape(-1, 8, 32) >> 4) & 1  # bit s of qh[l] is sub-block s's fifth bit
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qh, _nibbles(q)],
                          axis=1)  # fmt: skip


def _q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 32
    d_h, d = _fp16(scale.max(-1) / 127)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.rint(_safe_div(groups, step[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, quarter, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)  # fmt: skip
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d_h[:, None].view(np.uint8)], axis=1)


_ENCODERS = {Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}


def quantize(w: np.ndarray, ggml_type: int) -> np.ndarray:
    """w [rows, K] (K % 256 == 0) -> uint8 [rows, K / 256 * block bytes] in ggml's layout."""
    if int(ggml_type) not in _ENCODERS:
        raise ValueError(f"ggml type {ggml_type} is not a K-quant this encoder writes (Q4_K, Q5_K, Q6_K)")
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} values, got shape {w.shape}")
    rows = w.shape[0]
    blocks = _ENCODERS[int(ggml_type)](np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK_K))
    return np.ascontiguousarray(blocks.reshape(rows, -1))
