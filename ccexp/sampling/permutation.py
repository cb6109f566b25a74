"""Stateless pseudo-random permutations of ``[0, n)``, vectorised over many ``(i, n, key)`` at once.

The samplers need "the i-th element of a fresh random permutation of cluster c for pass p"
without storing O(N) permutations. A 4-round Feistel network on ``2·h`` bits (``4**h >= n``) is a
bijection of ``[0, 4**h)``; cycle-walking (re-encrypting while the value is ``>= n``) restricts it
to a bijection of ``[0, n)`` (Black & Rogaway, "Ciphers with Arbitrary Finite Domains", CT-RSA
2002, §3). Expected re-encryptions per element are below 4 because ``4**h < 4·n``.
"""
from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al., OOPSLA 2014): a bijective 64-bit hash, uint64 -> uint64."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + _GOLD
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def derive_keys(seed: int, *streams: np.ndarray | int) -> np.ndarray:
    """Hash a seed and any number of integer arrays (broadcast together) into uint64 keys."""
    key = mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    for s in streams:
        key = mix64(key ^ mix64(np.asarray(s).astype(np.uint64)))
    return key


def permute(i: np.ndarray, n: np.ndarray | int, key: np.ndarray | int) -> np.ndarray:
    """Position ``i`` of the pseudo-random permutation of ``[0, n)`` selected by ``key``.

    Args:
        i: int array, each ``0 <= i < n`` (broadcast with ``n`` and ``key``).
        n: domain sizes, ``>= 1``.
        key: uint64 permutation keys (e.g. from :func:`derive_keys`).

    Returns:
        int64 array: ``perm_key(i)``; for fixed ``(n, key)`` the map ``i -> perm_key(i)`` is a
        bijection of ``[0, n)``.

    Raises:
        ValueError: if any ``i`` is outside ``[0, n)``.
    """
    i, n, key = np.broadcast_arrays(np.asarray(i, dtype=np.int64), np.asarray(n, dtype=np.int64),
                                    np.asarray(key, dtype=np.uint64))
    if i.size == 0:
        return i.astype(np.int64)
    if np.any((i < 0) | (i >= n)):
        raise ValueError("permute: every i must satisfy 0 <= i < n")
    # half-width h per element: smallest h >= 1 with 4**h >= n
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.int64)
    half = np.maximum((bits + 1) // 2, 1).astype(np.uint64)
    mask = (np.uint64(1) << half) - np.uint64(1)
    round_keys = [mix64(key ^ np.uint64(r * 0x632BE59BD9B4E019 & 0xFFFFFFFFFFFFFFFF)) for r in range(4)]

    def encrypt(x: np.ndarray, sl) -> np.ndarray:
        h, m = half[sl], mask[sl]
        left, right = x >> h, x & m
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk[sl]) & m)
        return (left << h) | right

    x = encrypt(i.astype(np.uint64), slice(None))
    out_of_range = np.nonzero(x >= n.astype(np.uint64))[0]
    while out_of_range.size:  # cycle-walking, only over the elements still outside [0, n)
        x[out_of_range] = encrypt(x[out_of_range], out_of_range)
        out_of_range = out_of_range[x[out_of_range] >= n[out_of_range].astype(np.uint64)]
    return x.astype(np.int64)
