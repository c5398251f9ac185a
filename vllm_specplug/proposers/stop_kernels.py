"""The learned stopping rule's numba kernels (``stop_rule``): a candidate
draft's scoring and the calibration update, each the numpy functions'
operations in the same order, fused into one call (a test holds them to the
numpy functions). Compiled at engine start by the warm-up, cached on disk
(``jit``). No torch, no vLLM.
"""
from __future__ import annotations

import math

import numpy as np

from ..jit import njit


@njit
def _cell(edges, band, i, x):
    """(depth band, bin) of position ``i`` with estimate ``x``: the bin is
    ``np.searchsorted(edges, x, side="right")`` (an edge belongs to the bin
    above it), the band ``band[min(i, last)]``, as ``stop_rule`` bins them."""
    b = 0
    while b < edges.size and edges[b] <= x:
        b += 1
    return band[min(i, band.size - 1)], b


@njit
def score_kernel(w, depths, c, a1, table_p, shares, agree, support, hit, est, edges, band,
                 prior, cost, clip, support_cap):
    """``conditional`` then ``np.cumprod``, ``calibrated`` and ``best_cut`` in
    one pass, the same operations in the same order: (raw, q, m, rate). An
    empty ``shares``/``agree``/``support`` stands for None; ``c`` and ``a1``
    are ``logits``' per-draft constant and depth coefficient."""
    raw = np.empty(depths)
    q = np.empty(depths)
    acc = 1.0
    q_min = 1.0
    best_m, best_rate, gain = 0, 1.0, 1.0
    prev_t, prev_s = 1.0, 1.0
    for i in range(depths):
        dl = math.log1p(i)
        t = min(max(table_p[i], clip), 1.0)
        step = min(max(t / prev_t, clip), 1.0 - clip)
        prev_t = t
        tl = math.log(step / (1.0 - step))
        z = a1 * dl
        z += (w[4] + w[16] * dl) * tl
        z += c
        if i == 0:
            z += w[2]
        if shares.size > 0:
            sh = min(max(shares[i], clip), 1.0)
            st = min(max(sh / prev_s, clip), 1.0 - clip)
            prev_s = sh
            z += w[5] * math.log(st / (1.0 - st))
            z += w[7] * math.log(sh)
            z += w[6]
        if agree.size > 0:
            z += w[17] * agree[i]
            z += w[18]
        if support.size > 0:
            sup = support[i]
            z += w[19] * (1.0 if sup >= 1 else 0.0) + w[20] * (1.0 if sup >= 2 else 0.0)
            z += w[21] * math.log1p(min(sup, support_cap))
        acc = acc * (1.0 / (1.0 + math.exp(-z)))
        raw[i] = acc
        d, b = _cell(edges, band, i, acc)
        ratio = (hit[d, b] + prior * acc) / (est[d, b] + prior * acc)
        v = min(acc * ratio, 1.0)
        q_min = min(q_min, v)
        q[i] = q_min
        gain += q_min
        rate = gain / (1.0 + cost * (i + 1))
        if rate > best_rate:
            best_m, best_rate = i + 1, rate
    return raw, q, best_m, best_rate


@njit
def calibrate_kernel(est, hit, raw, n, accepted, decay, edges, band):
    """``observe``'s calibration update in place: both sums decayed by
    ``decay``, then each of the first ``n`` positions adds its estimate
    ``raw[i]`` (and 1 to the outcomes if accepted) to its (band, bin)."""
    est *= decay
    hit *= decay
    for i in range(n):
        d, b = _cell(edges, band, i, raw[i])
        est[d, b] += raw[i]
        if i < accepted:
            hit[d, b] += 1.0
