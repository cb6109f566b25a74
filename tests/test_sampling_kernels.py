"""The compiled kernels (ccexp.sampling.kernels) give the same numbers as the straightforward NumPy code
they replace: the vectorised pass arithmetic of ccexp.sampling.permutation, NumPy's own shuffle, and
argsort/bincount."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccexp.sampling import kernels
from ccexp.sampling.permutation import affine_permute, derive_keys, pass_hash, shuffled_groups

SETTINGS = settings(max_examples=40, deadline=None)


def reference_documents(members, starts, sizes, key, clusters, ordinal):
    """The vectorised NumPy path: draw ``ordinal`` of cluster c is position ``ordinal mod n_c`` of pass
    ``ordinal div n_c``'s affine permutation of the cluster's members."""
    clusters = np.asarray(clusters, np.int64)
    n = sizes[clusters]
    p = ordinal // n
    pos = affine_permute(ordinal - p * n, n, pass_hash(key, clusters, p)) + starts[clusters]
    return members[pos].astype(np.int64)


@st.composite
def grouped(draw):
    sizes = np.array(draw(st.lists(st.integers(0, 40), min_size=1, max_size=6)), np.int64)
    if sizes.sum() == 0:
        sizes[0] = 3
    labels = np.random.default_rng(draw(st.integers(0, 2**31))).permutation(
        np.repeat(np.arange(sizes.size), sizes)).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    key = np.uint64(derive_keys(draw(st.integers(0, 2**40)), 7))
    exposure = np.array([draw(st.integers(0, 500)) for _ in sizes], np.int64)
    return labels, sizes, starts, key, exposure


@SETTINGS
@given(n=st.integers(0, 3000), seed=st.integers(0, 2**40), buffered=st.booleans(),
       dtype=st.sampled_from([np.int32, np.int64]))
def test_shuffle_replays_numpy_and_leaves_the_generator_where_numpy_does(n, seed, buffered, dtype):
    a, b = np.random.default_rng(seed), np.random.default_rng(seed)
    if buffered:  # a 32-bit draw leaves half of a 64-bit output buffered
        a.integers(0, 7, dtype=np.uint32), b.integers(0, 7, dtype=np.uint32)
    expect = a.permutation(n)
    got = np.arange(n, dtype=dtype)
    kernels.shuffle_like_numpy(b, got)
    assert np.array_equal(got, expect)
    assert a.bit_generator.state == b.bit_generator.state and a.random() == b.random()


def test_shuffle_replays_numpy_on_a_large_array_in_several_chunks():
    n = 3_000_001  # about 2.1M outputs: three chunks of raw draws
    a, b = np.random.default_rng([3, 1]), np.random.default_rng([3, 1])
    expect = a.permutation(n)
    got = np.arange(n)
    kernels.shuffle_like_numpy(b, got)
    assert np.array_equal(got, expect) and a.bit_generator.state == b.bit_generator.state


def test_shuffle_refuses_another_bit_generator():
    with pytest.raises(TypeError, match="PCG64"):
        kernels.shuffle_like_numpy(np.random.Generator(np.random.MT19937(0)), np.arange(5))


@SETTINGS
@given(grouped(), st.integers(0, 2**31))
def test_shuffled_groups_and_counting_sort_equal_the_numpy_reference(data, seed):
    labels, sizes, *_ = data
    expect = shuffled_groups(labels, np.random.default_rng(seed))
    got = kernels.shuffled_groups(labels, sizes, np.random.default_rng(seed))
    assert got.dtype == expect.dtype and np.array_equal(got, expect)
    order = np.random.default_rng(seed).permutation(labels.size)
    assert np.array_equal(kernels.group_stable(order, labels, sizes),
                          order[np.argsort(labels[order], kind="stable")])
    score = np.random.default_rng(seed).integers(0, 4, labels.size).astype(np.float64)  # ties on purpose
    assert np.array_equal(kernels.group_stable(np.argsort(score, kind="stable"), labels, sizes),
                          np.lexsort((score, labels)))
    lo, hi, counts = kernels.label_counts(labels, sizes.size)
    assert (lo, hi) == (labels.min(), labels.max()) and np.array_equal(counts, sizes)


@SETTINGS
@given(grouped(), st.integers(1, 300), st.integers(0, 40))
def test_pass_block_equals_the_vectorised_pass_arithmetic(data, count, group):
    labels, sizes, starts, key, exposure = data
    c = int(np.argmax(sizes))
    members = kernels.shuffled_groups(labels, sizes, np.random.default_rng(0))
    out = np.full(count + 3, -1, np.int64)
    kernels.pass_block(members, starts[c], sizes[c], group, key, exposure[c], count, out, 3)
    ordinal = exposure[c] + np.arange(count)
    n = sizes[c]
    expect = members[starts[c] + affine_permute(ordinal % n, n, pass_hash(key, np.full(count, group), ordinal // n))]
    assert np.array_equal(out[3:], expect) and (out[:3] == -1).all()


@SETTINGS
@given(grouped(), st.integers(1, 200), st.integers(0, 2**31))
def test_stream_and_grouped_documents_equal_the_vectorised_path(data, count, seed):
    labels, sizes, starts, key, exposure = data
    members = kernels.shuffled_groups(labels, sizes, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    clusters = rng.choice(np.flatnonzero(sizes), count)
    # the t-th draw of cluster c in the stream is its draw number exposure[c] + t
    rank = np.empty(count, np.int64)
    order = np.argsort(clusters, kind="stable")
    first = np.searchsorted(clusters[order], clusters[order])
    rank[order] = np.arange(count) - first
    out = np.empty(count, np.int64)
    kernels.pass_stream(clusters, exposure, sizes, starts, members, key, out)
    assert np.array_equal(out, reference_documents(members, starts, sizes, key, clusters, exposure[clusters] + rank))

    counts = np.bincount(clusters, minlength=sizes.size).astype(np.int64)
    out = np.empty(count, np.int64)
    kernels.grouped_documents(counts, exposure, sizes, starts, members, key, out)
    by_cluster = np.sort(clusters)
    ordinal = exposure[by_cluster] + (np.arange(count) - np.searchsorted(by_cluster, by_cluster))
    assert np.array_equal(out, reference_documents(members, starts, sizes, key, by_cluster, ordinal))


@SETTINGS
@given(grouped(), st.integers(1, 500), st.integers(0, 2000), st.integers(0, 2**31))
def test_labelled_pass_equals_the_vectorised_path_and_counts_the_clusters(data, count, e0, seed):
    labels, sizes, _, key, _ = data
    packed = kernels.shuffled_packed(labels, np.random.default_rng(seed))
    base = np.random.default_rng(seed).permutation(labels.size)
    assert np.array_equal(packed & 0xFFFFFFFF, base) and np.array_equal(packed >> 32, labels[base])
    out = np.empty(count, np.int64)
    counts = np.zeros(sizes.size, np.int64)
    kernels.pass_block_labelled(packed, key, e0, count, out, counts)
    epoch, i = np.divmod(e0 + np.arange(count), labels.size)
    expect = base[affine_permute(i, labels.size, pass_hash(key, np.zeros_like(epoch), epoch))]
    assert np.array_equal(out, expect)
    assert np.array_equal(counts, np.bincount(labels[expect], minlength=sizes.size))


@SETTINGS
@given(n=st.integers(1, 3000), a=st.integers(2**31, 2**32), s0=st.integers(0, 2**31), data=st.data())
def test_ascending_order_of_an_affine_progression_is_its_sorted_order(n, a, s0, data):
    from math import gcd

    d, s0 = a % n, s0 % n
    if gcd(d, n) != 1:
        d = 1 if n > 1 else 0
    m = data.draw(st.integers(1, n))
    xs, ts = np.empty(m, np.int64), np.empty(m, np.int64)
    kernels._ascending(s0, d, n, m, xs, ts)
    x = (s0 + np.arange(m) * d) % n
    assert np.array_equal(ts, np.argsort(x)) and np.array_equal(xs, np.sort(x))


@SETTINGS
@given(grouped(), st.integers(1, 400), st.integers(0, 3000), st.integers(1, 9))
def test_the_ascending_sweep_equals_the_positions_and_gather(data, count, e0, tile):
    """The sweep (used for large groups only) on small ones, with tiny tiles to cross tile and pass
    boundaries."""
    labels, sizes, starts, key, _ = data
    c = int(np.argmax(sizes))
    members = kernels.shuffled_groups(labels, sizes, np.random.default_rng(1))
    expect, got = np.empty(count + 2, np.int64), np.full(count + 2, -1, np.int64)
    kernels._positions(starts[c], sizes[c], c, key, e0, count, expect, 2)
    kernels._gather(members, expect, 2, count + 2)
    kernels._sweep(members, starts[c], sizes[c], c, key, e0, count, got, 2, np.empty(tile, np.int64),
                   np.empty(tile, np.int64))
    assert np.array_equal(got[2:], expect[2:]) and (got[:2] == -1).all()


def test_warm_up_compiles_every_kernel():
    assert kernels.warm_up() >= 0.0


def test_without_a_writable_cache_the_kernels_compile_per_process_with_a_warning(monkeypatch):
    real = kernels.njit

    def no_cache(**options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x.py'")
        return real(**options)

    monkeypatch.setattr(kernels, "njit", no_cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        double = kernels._jit(lambda x: 2 * x)
    assert double(21) == 42 and "NUMBA_CACHE_DIR" in str(caught[0].message)


@pytest.mark.slow
def test_a_read_only_install_runs_the_kernels(tmp_path):
    """Installed on a read-only file system with no writable home: numba cannot cache, so the kernels
    compile in the process, with one warning — never an error. (As root, only a read-only mount stops
    writes: the check runs under ``unshare -m`` then, and is skipped where that is not allowed.)"""
    site, home = tmp_path / "site", tmp_path / "home"
    shutil.copytree(Path(kernels.__file__).resolve().parents[1], site / "ccexp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / "cache"), PYTHONPATH=str(site))
    code = ("import numpy as np, ccexp.sampling as s; from ccexp.sampling import kernels; kernels.warm_up(); "
            "x = s.UniformSampler(np.array([0, 1, 1], np.int32), np.array([1, 2]), block_size=4); "
            "print(x.next_block().tolist(), kernels.__file__)")
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("running as root without unshare: no way to make a folder read-only")
        mounts = " && ".join(f"mount --bind {p} {p} && mount -o remount,ro,bind {p}" for p in (site, home))
        cmd = ["unshare", "-m", "sh", "-c", f'{mounts} && exec "$0" -c "$1"', sys.executable, code]
    else:
        for path in [*site.rglob("*"), site, home]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True)
    for path in [*site.rglob("*"), site, home]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    if proc.returncode and "unshare" in proc.stderr:
        pytest.skip(f"unshare -m is not allowed here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(site) in proc.stdout and proc.stderr.count("no writable cache folder") == 1
    assert not list(site.rglob("*.nbi"))
