"""Cheap, stateless permutations for the samplers' passes.

A sampler needs "the i-th document of pass p over cluster c" — a fresh order for every pass —
without storing a permutation per pass. ccexp composes two permutations:

1. a **static base order**: the cluster's members shuffled once, at construction, by a seeded
   NumPy ``Generator`` (an O(N) index, like the members list itself, not state);
2. a **per-pass affine map** ``i -> (a·i + b) mod n`` with ``a`` a prime larger than ``n``
   (hence coprime with it, so the map is a bijection of ``[0, n)``) and ``a``, ``b`` drawn from a
   SplitMix64 hash of ``(seed, c, p)``.

Every pass therefore visits each member exactly once, in an order that differs from pass to pass,
and position lookups are a handful of integer operations per index — no per-index Python, no O(N)
state. The affine maps are not uniformly random permutations; they reorder a random base order,
which is what the samplers' invariants (counts per pass) and a training stream need.

The functions here are the vectorised NumPy definitions. The samplers' hot paths run the same
arithmetic in compiled loops ([`ccexp.sampling.kernels`][ccexp.sampling.kernels], tested equal to these), including
[`shuffled_groups`][ccexp.sampling.permutation.shuffled_groups] (``kernels.shuffled_groups``: the same result in O(N) without argsort).
"""
from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
MAX_DOMAIN = 2**31  # a·i must fit in 64 bits: a < 2**32 and i < 2**31


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases: the first 12 primes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n in small:
        return True
    if any(n % p == 0 for p in small):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_above(start: int, count: int) -> np.ndarray:
    out, n = [], start | 1
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 2
    return np.array(out, dtype=np.uint64)


# 64 multipliers in (2**31, 2**32): coprime with every domain size n < 2**31
_MULTIPLIERS = _primes_above(2**31 + 2**30, 64)


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


def pass_hash(key: np.uint64, group: np.ndarray, pass_idx: np.ndarray) -> np.ndarray:
    """uint64 hash of ``(key, group, pass)`` for ``group < 2**32``, ``pass < 2**32``."""
    with np.errstate(over="ignore"):
        packed = (group.astype(np.uint64) << np.uint64(32)) + pass_idx.astype(np.uint64)
    return mix64(key ^ packed)


def affine_permute(i: np.ndarray, n: np.ndarray | int, h: np.ndarray) -> np.ndarray:
    """Position ``i`` of the affine permutation of ``[0, n)`` selected by hash ``h``.

    Args:
        i: int64 positions, ``0 <= i < n``.
        n: int64 domain sizes, ``1 <= n < 2**31`` (broadcast with ``i`` and ``h``).
        h: uint64 hashes (e.g. [`pass_hash`][ccexp.sampling.permutation.pass_hash]); ``a`` comes from the low 6 bits, ``b`` from the high 32.

    Returns:
        int64 ``(a·i + b) mod n``: for fixed ``(n, h)`` a bijection of ``[0, n)``.
    """
    n = np.asarray(n, dtype=np.int64).view(np.uint64)
    a = _MULTIPLIERS[(h & np.uint64(63)).view(np.int64)]
    b = ((h >> np.uint64(32)) * n) >> np.uint64(32)  # "fastrange": uniform in [0, n) without a division
    with np.errstate(over="ignore"):
        a *= np.ascontiguousarray(i, dtype=np.int64).view(np.uint64)
        a += b
        a %= n
    return a.view(np.int64)


def shuffled_groups(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``labels`` grouped by label (ascending) and shuffled within each group.

    Returns int32 indices when ``len(labels) < 2**31`` (else int64): the static base order.
    """
    n = labels.size
    dtype = np.int32 if n < 2**31 else np.int64
    shuffle = rng.permutation(n).astype(dtype)
    return shuffle[np.argsort(labels[shuffle], kind="stable")].astype(dtype)
