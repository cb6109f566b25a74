"""Sampling policies: each yields the global batch of document indices for every optimizer step.

One module per policy; see [`ccexp.sampling.base`][ccexp.sampling.base] for the
protocol.
"""
from ccexp.sampling.base import Sampler, rank_slice
from ccexp.sampling.cluster_dp import ClusterDPSampler
from ccexp.sampling.clusterclip import ClusterClipSampler
from ccexp.sampling.dynamic import DynamicSampler
from ccexp.sampling.mixture import MixtureSampler
from ccexp.sampling.random import RandomSampler
from ccexp.sampling.sources import SourceMixture
from ccexp.sampling.temperature import TemperatureSampler
from ccexp.sampling.uniform import UniformSampler
from ccexp.sampling.unimax import UniMaxSampler

__all__ = ["Sampler", "rank_slice", "RandomSampler", "UniformSampler", "ClusterClipSampler", "DynamicSampler",
           "ClusterDPSampler", "TemperatureSampler", "UniMaxSampler",
           "MixtureSampler", "SourceMixture"]
