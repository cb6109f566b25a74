"""Compiled kernels of the samplers' hot paths (issue 14, "Samplers at memory speed").

Every sampler turns "the ``e``-th draw from group ``g``" into a document with the same arithmetic
([`ccexp.sampling.permutation`][ccexp.sampling.permutation]): pass ``p = e div n`` and position ``i = e mod n`` of the group's
``n`` members, the affine map ``(a·i + b) mod n`` keyed by the SplitMix64 hash of ``(key, g, p)``,
and a gather from the group's shuffled members. Vectorised, NumPy spent most of the time on
block-sized ``int64``/``uint64`` temporaries (a division, a modulo and ten hash passes per index), on
``argsort`` and ``permutation`` calls and on ``bincount``'s int64 copy of the labels. Here each draw
continues its group's pass *incrementally* — ``x_{i+1} = x_i + (a mod n)``, wrapped once; a division
and a hash only at a pass boundary — and what remains is the cache miss of the gather itself:

* the positions are computed first and gathered in a second, branch-free loop (a mispredicted
  wrap-around would flush the misses in flight); counts that depend on a gathered value are made
  in a third loop, for the same reason;
* a group far larger than the caches (``random``'s 800 MB base order at 100M documents) is read in
  ascending sweeps instead ([`_sweep`][ccexp.sampling.kernels._sweep], by the three-distance theorem), which the prefetcher and
  the TLB can follow;
* the construction-time shuffles replay NumPy's ([`shuffle_like_numpy`][ccexp.sampling.kernels.shuffle_like_numpy]) on (document, cluster)
  words, and grouping by cluster is a counting sort over them ([`shuffled_groups`][ccexp.sampling.kernels.shuffled_groups]): O(N), no
  label lookups at random, no ``argsort``.

**Why numba.** The loops are sequential (each draw continues its group's pass; Fisher-Yates swaps in
order), which NumPy cannot express without the temporaries above. numba (NumFOCUS-sponsored,
LLVM-based, releases in step with NumPy and CPython, wheels for every platform ccexp runs on)
compiles plain Python loops over NumPy arrays with no build step. Considered and not taken: a C or
Cython extension (a compiler and a per-platform build for every install, for a handful of short
loops), Rust through PyO3/maturin (the same, plus a second language), ``numexpr`` (element-wise
only: no sequential state, no gathers) and PyTorch ops (the same temporaries as NumPy). numba's cost
is a one-time JIT compile, 2-4 s per policy on first use (about 10 s for all, idle), cached next to this module
(``cache=True``); where that folder is read-only numba uses its user cache (``~/.cache/numba`` or
``NUMBA_CACHE_DIR``), and where no cache folder is writable the kernels compile in every process,
with one warning ([`_jit`][ccexp.sampling.kernels._jit]). [`warm_up`][ccexp.sampling.kernels.warm_up] compiles (or loads) them all and says how long it took.

**Same numbers as NumPy.** The random numbers still come from NumPy's ``Generator``; the kernels do
index arithmetic only. [`shuffle_like_numpy`][ccexp.sampling.kernels.shuffle_like_numpy] replays ``Generator.shuffle``'s Fisher-Yates loop
(NumPy's ``random_interval``: masked rejection on the 32-bit halves of PCG64's outputs, lower half
first) on outputs drawn by the generator's own bit generator, and leaves the generator in the state
NumPy's shuffle would. ``tests/test_sampling_kernels.py`` checks every kernel against its NumPy
reference ([`ccexp.sampling.permutation`][ccexp.sampling.permutation], ``Generator.permutation``, ``argsort``, ``bincount``).

Conventions: positions and counts are int64; members are int32 (int64 from ``2**31`` documents);
group sizes satisfy ``1 <= n < 2**31``; ``key`` is a ``numpy.uint64`` from
[`derive_keys`][ccexp.sampling.permutation.derive_keys]. Kernels write into NumPy-allocated outputs, so a
memory trace sees them; what they allocate themselves is O(K) or a scratch of ``_TILE`` entries.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
from numba import njit

from ccexp.sampling.permutation import _GOLD, _M1, _M2, _MULTIPLIERS

_U32 = np.uint64(32)


_UNCACHED: list[str] = []  # kernels numba could not cache (no writable cache folder)


def _jit(func):
    """``numba.njit(cache=True, nogil=True)``; without any writable cache folder (numba raises at
    decoration then), the kernel is compiled per process instead, with one warning per process."""
    try:
        return njit(cache=True, nogil=True)(func)
    except RuntimeError as e:  # "cannot cache function ...: no locator available for file ..."
        if not _UNCACHED:
            warnings.warn(f"ccexp.sampling.kernels: numba has no writable cache folder ({e}); the sampler "
                          "kernels are compiled again in every process: 2-4 s for each policy's kernels on first "
                          "use, about 10 s for all seven on an idle 2-core machine and up to a minute on a busy "
                          "one. Set NUMBA_CACHE_DIR to a writable folder to keep the compiled code.", RuntimeWarning,
                          stacklevel=2)
        _UNCACHED.append(func.__name__)
        return njit(cache=False, nogil=True)(func)


@njit(inline="always", nogil=True)  # inlined: cached within its callers
def _mix64(x):
    x = x + _GOLD
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@njit(inline="always", nogil=True)  # inlined: cached within its callers
def _affine(key, group, p, n, pos):
    """(x, step) of pass ``p`` of group ``group`` (size ``n``) at position ``pos``: ``x = (a·pos + b) mod n``,
    ``step = a mod n`` — [`affine_permute`][ccexp.sampling.permutation.affine_permute] of
    [`pass_hash`][ccexp.sampling.permutation.pass_hash], in uint64 as there."""
    h = _mix64(key ^ ((np.uint64(group) << _U32) + np.uint64(p)))
    a = _MULTIPLIERS[h & np.uint64(63)]
    un = np.uint64(n)
    b = ((h >> _U32) * un) >> _U32
    return np.int64((a * np.uint64(pos) + b) % un), np.int64(a % un)


@njit(inline="always", nogil=True)  # inlined: cached within its callers
def _advance(key, group, n, p, pos, x, step):
    """One draw further along group ``group``'s passes (size ``n``): ``(p, pos, x, step)`` of the next draw,
    ``x`` moving by ``step`` (wrapped once) inside a pass, a fresh [`_affine`][ccexp.sampling.kernels._affine] map at a pass boundary."""
    pos += 1
    if pos == n:
        x, step = _affine(key, group, p + 1, n, 0)
        return p + 1, 0, x, step
    x += step
    if x >= n:
        x -= n
    return p, pos, x, step


_TILE = 1 << 16  # draws per ascending sweep: enough to stream over a large array, small enough for L2
_SWEEP_BYTES = 1 << 26  # groups from 64 MiB up are read in ascending sweeps ([`_sweep`][ccexp.sampling.kernels._sweep]) ...
_SWEEP_DRAWS = 1 << 12  # ... when at least this many draws are taken from them at once


@_jit
def _positions(start, n, group, key, e0, count, out, out_start):
    """``out[out_start + t] = start + x_t`` (int64): where draw ``e0 + t`` of group ``group`` (size ``n``,
    members at ``[start, start+n)``) lies, for ``t < count``."""
    p = e0 // n
    pos = e0 - p * n
    x, step = _affine(key, group, p, n, pos)
    for j in range(out_start, out_start + count):
        out[j] = start + x
        p, pos, x, step = _advance(key, group, n, p, pos, x, step)


@_jit
def _gather(members, out, lo, hi):
    """``out[j] = members[out[j]]`` for ``lo <= j < hi``: the loop with the cache misses, kept free of
    data-dependent branches so that many of them are in flight at once."""
    for j in range(lo, hi):
        out[j] = members[out[j]]


@_jit
def _ascending(s0, d, n, m, xs, ts):
    """The points ``x_t = (s0 + t·d) mod n``, ``t < m`` (``gcd(d, n) = 1``, ``m <= n``), in ascending order:
    ``xs[k]`` the k-th smallest and ``ts[k]`` its ``t``, in O(m) by the three-distance theorem (Sós
    1958; Slater 1967): with ``k1`` the ``t > 0`` of the smallest ``t·d mod n`` and ``k2`` that of the
    largest, the point after ``t`` is ``t + k1`` if ``t + k1 < m``, else ``t - k2`` if ``t >= k2``, else
    ``t + k1 - k2`` (gaps ``g1 = k1·d mod n``, ``g2 = n - k2·d mod n``, ``g1 + g2``)."""
    q, lo, k1, hi, k2, first, t0 = 0, n, 0, -1, 0, n, 0
    for t in range(m):
        x = s0 + q
        if x >= n:
            x -= n
        if x < first:
            first, t0 = x, t
        if t > 0 and q < lo:
            lo, k1 = q, t
        if t > 0 and q > hi:
            hi, k2 = q, t
        q += d
        if q >= n:
            q -= n
    t, x = t0, first
    for k in range(m):
        xs[k] = x
        ts[k] = t
        if t + k1 < m:
            t += k1
            x += lo
        elif t >= k2:
            t -= k2
            x += n - hi
        else:
            t += k1 - k2
            x += lo + n - hi


@_jit
def _sweep(members, start, n, group, key, e0, count, out, out_start, xs, ts):
    """``out[out_start + t] = members[start + x_t]`` for draws ``e0 .. e0+count-1`` of group ``group``
    (the result of [`_positions`][ccexp.sampling.kernels._positions] then [`_gather`][ccexp.sampling.kernels._gather]), reading ``members`` in ascending order
    within each pass and tile of ``len(xs)`` draws: the hardware prefetcher and the TLB then follow
    the reads, where draws in stream order jump across the whole array. Worth its two extra passes
    only on a group far larger than the caches (``random`` at 100M documents, 800 MB: ~25% faster;
    a 6 MB ``cluster_dp`` lane or a 60 MB cluster: slower), so [`_draws`][ccexp.sampling.kernels._draws] decides."""
    j = 0
    while j < count:
        e = e0 + j
        p = e // n
        i = e - p * n
        m = min(count - j, n - i, xs.size)
        x, step = _affine(key, group, p, n, i)
        _ascending(x, step, n, m, xs, ts)
        base = out_start + j
        for k in range(m):
            out[base + ts[k]] = members[start + xs[k]]
        j += m


@_jit
def _draws(members, start, n, group, key, e0, count, out, out_start, xs, ts):
    """[`_sweep`][ccexp.sampling.kernels._sweep] for many draws from a group of ``_SWEEP_BYTES`` or more, else [`_positions`][ccexp.sampling.kernels._positions]
    then [`_gather`][ccexp.sampling.kernels._gather] (same result)."""
    if count >= _SWEEP_DRAWS and n * members.itemsize >= _SWEEP_BYTES:
        _sweep(members, start, n, group, key, e0, count, out, out_start, xs, ts)
    else:
        _positions(start, n, group, key, e0, count, out, out_start)
        _gather(members, out, out_start, out_start + count)


@_jit
def pass_block(members, start, n, group, key, e0, count, out, out_start):
    """Draws ``e0 .. e0+count-1`` of group ``group``, written to ``out[out_start:out_start+count]``.

    Args:
        members: int32 or int64[*] holding the group's shuffled members at ``[start, start+n)``.
        start, n, group, e0, count, out_start: int64 (``n >= 1``, ``e0 >= 0``).
        key: uint64 pass key.
        out: int64[*] output.
    """
    tile = min(count, _TILE)
    _draws(members, start, n, group, key, e0, count, out, out_start, np.empty(tile, np.int64),
           np.empty(tile, np.int64))


@_jit
def pass_block_labelled(packed, key, e0, count, out, counts):
    """``random``'s draws ``e0 .. e0+count-1`` of the one group of all ``n = len(packed)`` documents
    (pass = epoch), with their clusters counted.

    Args:
        packed: int64[n], ``document | cluster << 32`` of the base order.
        key: uint64 pass key; e0, count: int64.
        out: int64[count] documents (output).
        counts: int64[K], incremented by the clusters drawn (in a second loop: an increment that
            waits on a cache miss stalls the misses behind it).
    """
    pass_block(packed, 0, packed.size, 0, key, e0, count, out, 0)
    for j in range(count):
        v = out[j]
        counts[v >> 32] += 1
        out[j] = v & 0xFFFFFFFF


@_jit
def pass_stream(clusters, exposure, sizes, starts, members, key, out):
    """Documents of a stream of cluster draws: the ``t``-th draw of cluster ``c`` in ``clusters`` is its
    draw number ``exposure[c] + t`` (``uniform``'s rounds).

    Args:
        clusters: int64[B] cluster of each draw, in stream order (non-empty clusters only).
        exposure: int64[K] draws of each cluster before this stream.
        sizes, starts: int64[K] cluster sizes and offsets of their members in ``members``.
        members: int32 or int64[N] documents grouped by cluster, shuffled within.
        key: uint64 pass key.
        out: int64[B] documents (output).
    """
    state = np.full((sizes.size, 4), -1, np.int64)  # per cluster: position, pass, x, step
    for j in range(clusters.size):
        c = clusters[j]
        n = sizes[c]
        pos = state[c, 0]
        if pos < 0:
            p = exposure[c] // n
            pos = exposure[c] - p * n
            x, step = _affine(key, c, p, n, pos)
        else:
            p, x, step = state[c, 1], state[c, 2], state[c, 3]
        out[j] = starts[c] + x
        p, pos, x, step = _advance(key, c, n, p, pos, x, step)
        state[c, 0], state[c, 1], state[c, 2], state[c, 3] = pos, p, x, step
    _gather(members, out, 0, clusters.size)


@_jit
def grouped_documents(counts, exposure, sizes, starts, members, key, out):
    """Documents of ``counts[c]`` draws from each cluster, grouped by cluster (ascending) — the sorted
    order that the i.i.d. policies then shuffle: cluster c's draws are its numbers
    ``exposure[c] .. exposure[c]+counts[c]-1``. Arguments as [`pass_stream`][ccexp.sampling.kernels.pass_stream] (``counts``: int64[K])."""
    tile = min(out.size, _TILE)
    xs, ts = np.empty(tile, np.int64), np.empty(tile, np.int64)
    j = 0
    for c in range(counts.size):
        m = counts[c]
        if m > 0:
            _draws(members, starts[c], sizes[c], c, key, exposure[c], m, out, j, xs, ts)
            j += m


@_jit
def token_fair_documents(weights, taken, exposure, quota, sizes, starts, members, document_tokens, key, out):
    """Documents chosen so that each cluster's *tokens* follow ``weights``: weighted fair queueing with
    eligibility (WF²Q, Bennett & Zhang 1996; the rule and bound of [`ccexp.sampling.sources`][ccexp.sampling.sources], with
    clusters for sources). Cluster ``c``'s next document is its draw number ``exposure[c]`` (its passes,
    as [`pass_stream`][ccexp.sampling.kernels.pass_stream]); among the clusters with ``weights[c] > 0`` and ``quota[c] > 0`` that are not
    ahead (``taken[c] <= weights[c] · Σ taken``) the one whose next document finishes first,
    ``(taken[c] + tokens) / weights[c]``, is chosen (ties: lowest id). O(K) per document.

    Args:
        weights: float64[K] target token shares of the clusters in play (summing to 1 over them).
        taken: int64[K] tokens taken from each cluster since the shares last changed (updated).
        exposure: int64[K] draws of each cluster so far (updated).
        quota: int64[K] draws each cluster may still take (updated; a cluster leaves at 0).
        sizes, starts, members, key: as [`pass_stream`][ccexp.sampling.kernels.pass_stream].
        document_tokens: int64[N] tokens of each document.
        out: int64[B] documents (output).

    Returns:
        the number of documents written: ``B``, or fewer when a cluster used its last quota (the set of
        clusters in play changed: the caller renormalises ``weights`` and starts ``taken`` again) or
        no cluster is left in play (then possibly 0).
    """
    k = sizes.size
    state = np.zeros((k, 4), np.int64)  # per cluster: position, pass, x, step of its next draw
    pending = np.full(k, -1, np.int64)  # per cluster: its next document
    for c in range(k):
        if weights[c] > 0 and quota[c] > 0 and sizes[c] > 0:
            n = sizes[c]
            p = exposure[c] // n
            pos = exposure[c] - p * n
            x, step = _affine(key, c, p, n, pos)
            state[c, 0], state[c, 1], state[c, 2], state[c, 3] = pos, p, x, step
            pending[c] = members[starts[c] + x]
    total = taken.sum()
    for j in range(out.size):
        best = _fair_choice(weights, taken, pending, document_tokens, total)
        if best < 0:
            return j
        d = pending[best]
        out[j] = d
        taken[best] += document_tokens[d]
        total += document_tokens[d]
        exposure[best] += 1
        quota[best] -= 1
        if quota[best] <= 0:
            return j + 1
        p, pos, x, step = _advance(key, best, sizes[best], state[best, 1], state[best, 0], state[best, 2],
                                   state[best, 3])
        state[best, 0], state[best, 1], state[best, 2], state[best, 3] = pos, p, x, step
        pending[best] = members[starts[best] + x]
    return out.size


@njit(inline="always", nogil=True)  # inlined: cached within its caller
def _fair_choice(weights, taken, pending, document_tokens, total):
    """WF²Q's choice among the clusters with a pending document (``pending[c] >= 0``): the eligible one
    (``taken[c] <= weights[c] · total``) whose next document finishes first; the most behind should
    rounding leave none eligible; -1 when no cluster is in play."""
    best, best_key, fallback, fallback_key = -1, np.inf, -1, np.inf
    for c in range(weights.size):
        if pending[c] < 0:
            continue
        w = weights[c]
        ratio = taken[c] / w
        if ratio < fallback_key:
            fallback, fallback_key = c, ratio
        if taken[c] > w * total:
            continue  # ahead of its share: not eligible
        finish = (taken[c] + document_tokens[pending[c]]) / w
        if finish < best_key:
            best, best_key = c, finish
    return best if best >= 0 else fallback


@_jit
def _fisher_yates(x, u32, pending, i, js):
    """NumPy's ``Generator.shuffle`` loop (``for i = n-1 .. 1: j = random_interval(i); swap x[i], x[j]``)
    from ``i`` down, on the 32-bit draws ``pending`` (a buffered one, or -1) then ``u32`` (uint32[*]: the
    generator's 64-bit outputs, lower half first), while they last.

    ``random_interval(i)`` is masked rejection: ``v = draw & mask`` (``mask`` = the smallest ``2**k - 1
    >= i``) until ``v <= i``. The draws are scanned without a branch per draw, ``len(js)`` accepted
    ``j`` at a time (uint32 scratch), then those swaps are made: a mispredicted branch would stall the
    swaps' cache misses. Returns ``(i, s)``: the next ``i`` (0 when done) and the draws of ``u32`` used.
    """
    s = 0
    ns = u32.size
    mask = np.int64(1)
    while mask < i:
        mask = 2 * mask + 1
    while i > 0 and (s < ns or pending >= 0):
        top = i
        limit = min(js.size, i)
        cnt = 0
        if pending >= 0:
            v = pending & mask
            pending = -1
            js[0] = v
            ok = np.int64(v <= top)
            cnt += ok
            top -= ok
            if top <= mask >> 1:
                mask >>= 1
        while cnt < limit and s < ns:
            v = np.int64(u32[s]) & mask
            s += 1
            js[cnt] = v
            ok = np.int64(v <= top)
            cnt += ok
            top -= ok
            if top <= mask >> 1:
                mask >>= 1
        for t in range(cnt):
            a = i - t
            j = js[t]
            tmp = x[a]
            x[a] = x[j]
            x[j] = tmp
        i -= cnt
    return i, s


def shuffle_like_numpy(rng: np.random.Generator, x: np.ndarray) -> None:
    """Shuffle the 1-D array ``x`` in place exactly as ``rng.shuffle(x)`` would, and leave ``rng`` in the
    state that call would (NumPy's Fisher-Yates, replayed on ``rng``'s own PCG64 outputs; arrays of
    ``2**32`` elements or more, where NumPy draws 64 bits per swap, are handed to ``rng.shuffle``).

    Raises:
        TypeError: if ``rng`` is not driven by PCG64 (``np.random.default_rng``'s bit generator).
    """
    bg = rng.bit_generator
    if not isinstance(bg, np.random.PCG64):
        raise TypeError(f"shuffle_like_numpy replays PCG64's outputs, got {type(bg).__name__}")
    if x.size > 2**32:
        rng.shuffle(x)
        return
    if x.size < 2:
        return
    start = bg.state
    pending = int(start["uinteger"]) if start["has_uint32"] else -1
    upper, i, used = int(start["uinteger"]), x.size - 1, 0
    js = np.empty(min(i, 4096), np.uint32)
    while i > 0:  # about 0.7 outputs per element (rejection on a power-of-two mask); drawn in chunks
        u32 = bg.random_raw(min(1 << 20, int(i * 0.72) + 64)).view(np.uint32)
        i, s = _fisher_yates(x, u32, pending, i, js)
        pending = int(u32[s]) if s % 2 else -1  # the upper half of an output is buffered for the next draw
        used += (s + 1) // 2
        upper = int(u32[(s - 1) | 1]) if s else upper  # NumPy keeps the last upper half drawn
    bg.state = start  # rewind, then advance by the outputs used: the state NumPy's shuffle leaves
    bg.advance(used)
    end = bg.state
    end["has_uint32"], end["uinteger"] = int(pending >= 0), upper
    bg.state = end


def _offsets(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


@_jit
def _group_stable(order, labels, offsets, out, buf):
    n = order.size
    for lo in range(0, n, buf.size):  # the clusters of a chunk first: their cache misses overlap
        hi = min(lo + buf.size, n)
        for i in range(lo, hi):
            buf[i - lo] = labels[order[i]]
        for i in range(lo, hi):
            c = buf[i - lo]
            out[offsets[c]] = order[i]
            offsets[c] += 1


def group_stable(order: np.ndarray, labels: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``order[argsort(labels[order], kind="stable")]`` by a counting sort: the entries of ``order`` (int32
    or int64[N], documents) grouped by their cluster ``labels[d]`` (int32[N], in ``[0, K)``; ``sizes``:
    int64[K] their counts), in their order within a group. O(N); returns an array of ``order``'s dtype."""
    out = np.empty_like(order)
    _group_stable(order, labels, _offsets(sizes), out, np.empty(min(order.size, 1 << 16), np.int32))
    return out


@_jit
def pack_labelled(labels, out):
    """``out[i] = i | labels[i] << 32`` (int64[N], N < 2**31): a document and its cluster in one 8-byte
    word — ``random``'s base order (one cache line per draw) and the input of [`shuffled_groups`][ccexp.sampling.kernels.shuffled_groups]."""
    for i in range(labels.size):
        out[i] = i | (np.int64(labels[i]) << 32)


def shuffled_packed(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int64[N] words ``d | labels[d] << 32`` in the order ``rng.permutation(N)`` gives the documents d
    (``N < 2**31``; ``rng`` is left as that call leaves it)."""
    packed = np.empty(labels.size, np.int64)
    pack_labelled(labels, packed)
    shuffle_like_numpy(rng, packed)
    return packed


@_jit
def _group_packed(packed, offsets, out):
    for i in range(packed.size):
        v = packed[i]
        c = v >> 32
        out[offsets[c]] = v & 0xFFFFFFFF
        offsets[c] += 1


def shuffled_groups(labels: np.ndarray, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[`ccexp.sampling.permutation.shuffled_groups`][ccexp.sampling.permutation.shuffled_groups] (same result, same use of ``rng``): the
    permutation replayed on (document, cluster) words ([`shuffled_packed`][ccexp.sampling.kernels.shuffled_packed]), then a stable counting
    sort by cluster that reads them in order — O(N), no label lookups at random.

    Args:
        labels: int32[N] cluster ids in ``[0, K)``; sizes: int64[K] their counts.

    Returns:
        int32[N] (int64 from ``2**31`` documents): members of cluster 0, then 1, …, shuffled within.
    """
    if labels.size >= 2**31:
        order = np.arange(labels.size, dtype=np.int64)
        shuffle_like_numpy(rng, order)
        return group_stable(order, labels, sizes)
    out = np.empty(labels.size, np.int32)
    _group_packed(shuffled_packed(labels, rng), _offsets(sizes), out)
    return out


@_jit
def _count_labels(labels, counts):
    lo = hi = labels[0]
    k = counts.shape[1]
    for i in range(labels.size):
        c = labels[i]
        lo = min(lo, c)
        hi = max(hi, c)
        if 0 <= c < k:
            counts[i & 3, c] += 1  # four rows: runs of one cluster do not wait on each other's increments
    return lo, hi


def label_counts(labels: np.ndarray, k: int) -> tuple[int, int, np.ndarray]:
    """``(min, max, counts)`` of non-empty int32[N] ``labels``: counts is int64[k], the number of labels
    equal to each ``c < k`` (``np.bincount`` without its int64 copy of the labels)."""
    counts = np.zeros((4, k), np.int64)
    lo, hi = _count_labels(labels, counts)
    return int(lo), int(hi), counts.sum(axis=0)


def warm_up() -> float:
    """Compile (or load from numba's cache) every kernel for the dtypes the samplers pass; returns the
    seconds it took. Call it before timing anything: a kernel compiles on its first call."""
    t0 = time.perf_counter()
    key = np.uint64(1)
    sizes = np.array([2, 1], np.int64)
    starts = np.array([0, 2], np.int64)
    exposure = np.zeros(2, np.int64)
    out = np.empty(3, np.int64)
    for members in (np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)):
        pass_block(members, 0, 2, 0, key, 0, 3, out, 0)
        pass_stream(np.array([0, 1, 0], np.int64), exposure, sizes, starts, members, key, out)
        grouped_documents(np.array([2, 1], np.int64), exposure, sizes, starts, members, key, out)
        token_fair_documents(np.array([0.5, 0.5]), np.zeros(2, np.int64), np.zeros(2, np.int64),
                             np.full(2, 9, np.int64), sizes, starts, members, np.ones(3, np.int64), key, out)
        group_stable(members, np.array([0, 0, 1], np.int32), sizes)
        shuffle_like_numpy(np.random.default_rng(0), members)
    labels = np.array([0, 0, 1], np.int32)
    label_counts(labels, 2)
    shuffled_groups(labels, sizes, np.random.default_rng(0))
    pass_block_labelled(shuffled_packed(labels, np.random.default_rng(0)), key, 0, 3, out, np.zeros(2, np.int64))
    return time.perf_counter() - t0
