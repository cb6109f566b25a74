"""``dynamic``: online cluster reweighting from the training loss (ODM: Albalak et al. 2023; DoReMi: Xie et al. 2023).

Cluster weights ``π`` (on the simplex) are updated every ``update_every`` optimizer steps after
``warmup_steps`` from the per-cluster mean token loss ``L_c`` that the runner reports through
`observe` (summed over the window, the step's micro-batches and all data-parallel ranks).
Until the first ``warmup_steps`` optimizer steps have been observed, clusters are drawn in
``uniform``'s rounds; after that, i.i.d. from ``π`` (one generator per block, keyed by the seed and
the block index). Documents within a cluster are passes over a permutation, as in ``uniform``; the
optional repetition clip is ClusterClip's (``clip_threshold``, ``on_exhausted``).

Rules (``K`` = non-empty clusters, ``t`` = optimizer steps since the warm-up ended, 1-based):

* ``odm`` (default) — Online Data Mixing, Albalak et al., arXiv 2312.02406, smoothed-mean EXP3
  (``group_update`` in the reference code, ``megatron/data/data_sampling_utils.py``):
  ``R_c ← β R_c + (1-β) exp(L_c)``, ``ε_t = min(1/K, sqrt(ln K / (K t)))``,
  ``w_c = (1 - K ε_t) R_c / Σ_j R_j + ε_t`` (the paper's ``ε_{t-1}`` factors cancel), ``π = w``.
  ``t`` counts optimizer steps, as in ODM, which updates every step (since
  2026-11-30): with ``t`` in updates and ``update_every=10``, ``ε_t`` stayed ``1/K`` (``π`` exactly
  uniform) for ``K ln K`` updates — the whole default run at K=32. Exploration ends (``ε_t < 1/K``)
  after ``K ln K`` steps (111 at K=32). A cluster's ``R`` starts at its first observation; clusters
  never observed take the mean ``R``.
* ``doremi`` — DoReMi's excess-loss update, Xie et al., arXiv 2305.10429, Alg. 1, as the authors'
  ``update_domain_weights`` (sangmichaelxie/doremi, ``doremi/trainer.py``, ``doremiv1``), with a
  reference model's per-cluster loss ``L_ref`` (``reference_losses``; by default the ``reference``
  stage's, a short ``sampler=random`` run on the same data, `ccexp.training.reference.reference_losses`):
  ``λ_c = max(L_c − L_ref,c, 0)`` for a cluster seen in the window (the last ``λ_c`` for one that was
  not, as the authors keep ``perdomain_scores``), ``α = softmax(log π + η_t · λ)``,
  ``π ← (1-ε) α + ε/K``: each update starts from the previous *smoothed* weights, so a cluster that fell
  behind catches up as soon as its excess loss exceeds the others' (corrected 2026-12-02: an unbounded
  running sum of ``log w`` was kept before, and a cluster that fell behind could never catch up).
  DoReMi's ``η = 1``, ``ε = 1e-3`` are taken per token of evidence: ``η_t = η · (n_t / K) / eta_tokens``,
  ``n_t`` the update's tokens, ``eta_tokens`` = 2^19 / 22 = 23,831 the tokens per domain of one DoReMi
  step (a batch of 512 x 1,024 tokens over the Pile's 22 domains, Sec. 3). Taken per update instead (as
  in the paper, ``eta_tokens=null``), a run of 2,048-token steps over K = 32 clusters has ~64 tokens
  per cluster mean: η = 1 then follows the noise. Two differences from the authors' code remain,
  both documented in docs/policies.md: the excess is clipped per *cluster mean* (ccexp's reference is
  one loss per cluster, not per token: ``max(mean(ℓ) − L_ref, 0)`` where the authors take
  ``mean(max(ℓ − ℓ_ref, 0))`` over tokens, which is larger whenever some tokens beat the reference), and
  clusters are *drawn* from ``π`` (the authors draw from the initial mix and reweight the loss by ``π``).

Invariants (tested): ``π`` stays on the simplex with ``π_c ≥ ε_t``; equal losses keep ``π``
uniform; a cluster with persistently higher loss gains probability; no update during warm-up.
`average_weights` is DoReMi's output, the mixture to reuse (Xie et al. 2023, Alg. 1, "return
the average weights"): ``π`` averaged over the updates (the weights after each update, as the authors'
``write_weights`` averages them), given as *token shares* (``π_c · μ_c`` normalised, ``μ_c`` the mean
tokens of cluster c's documents: ``π`` draws documents, and a mixture's weights are shares of tokens).
State: O(K) (``R``, ``λ``, ``π``, the open window's sums, counters of updates and observed steps).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ccexp.data.userfiles import read_json
from ccexp.errors import CcexpError
from ccexp.sampling.base import token_shares
from ccexp.sampling.clip import RepetitionClip
from ccexp.sampling.uniform import UniformSampler

_DYNAMIC_STREAM = 0x44594E41  # "DYNA"


def load_reference_losses(source: str | Sequence[float] | None, num_clusters: int | None) -> np.ndarray | None:
    """float64[K] reference per-cluster losses (nats per token, finite and >= 0) from a list, a ``.npy``
    file or a JSON list file (``num_clusters`` None: any K, for a check before the clustering).

    Raises:
        CcexpError: if the file is missing, a folder or unreadable, a value is not a number, non-finite
            or negative, the length is not K, or ``source`` is ``"auto"`` (which only a training run
            resolves, through its ``reference`` stage).
    """
    if source is None:
        return None
    if isinstance(source, str) and source == "auto":
        raise CcexpError("sampler.reference_losses=auto is computed by a training run's reference stage "
                         "(python -m ccexp); here give a list, or the reference_losses.npy that stage wrote")
    name = f"sampler.reference_losses={str(source)!r}" if isinstance(source, (str, Path)) else "sampler.reference_losses"
    try:
        if isinstance(source, (str, Path)):
            path = Path(source).expanduser()
            if not path.is_file():
                what = "is a folder" if path.is_dir() else "does not exist"
                raise CcexpError(f"{name} {what}; give a .npy or .json file with one loss per cluster")
            raw = np.load(path, allow_pickle=False) if path.suffix == ".npy" else \
                read_json(path, name, "a UTF-8 JSON list", noun="cluster")
        else:
            raw = list(source)
        if isinstance(raw, np.ndarray) and raw.dtype.kind not in "iuf":
            raise CcexpError(f"{name} holds {raw.dtype} values; reference losses are numbers (float)")
        for c, v in enumerate(raw if isinstance(raw, list) else []):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise CcexpError(f"{name}: cluster {c}'s loss is {v!r}, not a number; reference losses are nats per "
                                 "token, one number per cluster")
        values = np.asarray(raw, dtype=np.float64)
    except CcexpError:
        raise
    except Exception as e:  # unreadable file, not JSON, strings or objects where numbers belong
        raise CcexpError(f"{name} cannot be read as {num_clusters} numbers ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'}); give a list, a .npy array or a JSON "
                         "list of floats, one loss per cluster") from None
    if values.ndim != 1 or (num_clusters is not None and values.shape != (num_clusters,)):
        raise CcexpError(f"{name} must hold {num_clusters or 'K'} values (one per cluster), got shape {values.shape}")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        c = int(np.flatnonzero(bad)[0])
        raise CcexpError(f"{name}: cluster {c}'s loss is {values[c]}; reference losses are nats per token, finite "
                         "and >= 0")
    return values


class DynamicSampler(UniformSampler):
    """Online cluster reweighting; see the module docstring.

    Args:
        labels: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        sizes: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        block_size: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        seed: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        document_tokens: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        token_budget: see [`ccexp.sampling.base.Sampler`][ccexp.sampling.base.Sampler].
        rule: ``odm`` or ``doremi`` (the latter needs ``reference_losses``).
        update_every: steps per weight update (1, as ODM; ``ε_t`` counts steps either way).
        warmup_steps: optimizer steps sampled uniformly over clusters, without updates (the config's
            default is 5 % of ``train.steps``).
        beta: ODM smoothing of the reward, in [0, 1).
        eta: DoReMi step size, > 0.
        epsilon: DoReMi smoothing towards uniform, in [0, 1].
        eta_tokens: tokens per cluster per update at which ``eta`` applies as given (None: per update).
        reference_losses: DoReMi's per-cluster reference loss (float[K], a list, a .npy or a .json file),
            nats/token; ``"auto"`` is the config's default, which the run's ``reference`` stage replaces
            by an array (given to the constructor itself, it is refused: there is no reference run here).
        clip_threshold: ClusterClip's repetition clip M ([`RepetitionClip`][ccexp.sampling.clip.RepetitionClip]);
            None = no clip.
        on_exhausted: the clip's ``error`` or ``reset`` when every cluster is exhausted.

    Raises:
        CcexpError: for an unknown rule or an invalid parameter.
    """

    name = "dynamic"

    needs_feedback = True  # its weights follow the per-cluster training loss

    def __init__(self, labels: np.ndarray, sizes: np.ndarray, *, block_size: int = 64, seed: int = 0,
                 document_tokens: np.ndarray | None = None, token_budget: int | None = None, rule: str = "odm",
                 update_every: int = 1, warmup_steps: int = 50, beta: float = 0.9, eta: float = 1.0,
                 epsilon: float = 1e-3, eta_tokens: float | None = 524288 / 22,
                 reference_losses: str | Sequence[float] | None = "auto",
                 clip_threshold: int | None = None, on_exhausted: str = "error"):
        clip = None if clip_threshold is None else RepetitionClip(sizes, clip_threshold, on_exhausted)
        super().__init__(labels, sizes, block_size=block_size, seed=seed, document_tokens=document_tokens,
                         token_budget=token_budget, clip=clip)
        if rule not in ("odm", "doremi"):
            raise CcexpError(f"sampler.rule={rule!r} is not an option; use 'odm' or 'doremi'")
        if int(update_every) < 1 or int(warmup_steps) < 0:
            raise CcexpError("sampler.update_every must be >= 1 and sampler.warmup_steps >= 0")
        if not (0.0 <= beta < 1.0 and eta > 0 and 0.0 <= epsilon <= 1.0 and (eta_tokens is None or 0 < eta_tokens < np.inf)
                and eta < np.inf):  # written so that NaN fails too
            raise CcexpError(f"need 0 <= sampler.beta < 1, sampler.eta > 0, 0 <= sampler.epsilon <= 1, sampler.eta_tokens "
                             f"> 0 or null; got beta={beta}, eta={eta}, epsilon={epsilon}, eta_tokens={eta_tokens}")
        self.reference_losses = load_reference_losses(reference_losses, self.num_clusters) if rule == "doremi" else None
        if rule == "doremi" and self.reference_losses is None:
            raise CcexpError("sampler.rule=doremi needs sampler.reference_losses (a reference model's per-cluster "
                             "loss); use rule=odm without one")
        self.rule, self.update_every, self.warmup_steps = rule, int(update_every), int(warmup_steps)
        self.beta, self.eta, self.epsilon = float(beta), float(eta), float(epsilon)
        self.eta_tokens = None if eta_tokens is None else float(eta_tokens)
        self._present = self.sizes > 0
        self._k = int(self._present.sum())
        self._pi = np.where(self._present, 1.0 / self._k, 0.0)
        self._reward = np.full(self.num_clusters, np.nan)
        self._excess = np.zeros(self.num_clusters)  # DoReMi's λ: the last excess loss of each cluster
        self._updates = 0
        self._steps_observed = 0
        self._window_loss = np.zeros(self.num_clusters)
        self._window_tokens = np.zeros(self.num_clusters, dtype=np.int64)
        self._pi_sum = np.zeros(self.num_clusters)  # Σ π over the updates (average_weights)

    # -- the feedback loop --------------------------------------------------------------------
    def observe(self, step: int, cluster_loss: np.ndarray, cluster_tokens: np.ndarray) -> None:
        """Add optimizer step ``step``'s per-cluster summed token loss (float[K], nats) and token counts
        (int[K]); update ``π`` at the end of every ``update_every``-step window after warm-up."""
        self._steps_observed = step + 1
        self._window_loss += np.asarray(cluster_loss, dtype=np.float64)
        self._window_tokens += np.asarray(cluster_tokens, dtype=np.int64)
        if (step + 1) % self.update_every:
            return
        if step + 1 > self.warmup_steps and self._window_tokens.any():  # no token, no evidence: no update
            seen = self._window_tokens > 0
            mean_loss = np.zeros(self.num_clusters)
            mean_loss[seen] = self._window_loss[seen] / self._window_tokens[seen]
            self._update(mean_loss, seen, int(self._window_tokens.sum()))
        self._window_loss[:] = 0.0
        self._window_tokens[:] = 0

    def steps_since_warmup(self) -> int:
        return max(0, self._steps_observed - self.warmup_steps)

    def average_draw_weights(self) -> np.ndarray:
        """float64[K]: ``π`` (the clusters' draw probabilities) averaged over the updates (the current ``π``
        before any), as the authors' ``write_weights`` averages ``train_domain_weights``."""
        return self._pi_sum / self._updates if self._updates else self._pi.copy()

    def average_weights(self) -> np.ndarray:
        """float64[K] token shares of [`average_draw_weights`][ccexp.sampling.dynamic.DynamicSampler.average_draw_weights]: each cluster's averaged draw probability
        times its mean document tokens, normalised (see the module docstring)."""
        return token_shares(self.average_draw_weights(), self.mean_document_tokens())

    def epsilon_t(self, t: int) -> float:
        """ODM's exploration rate ``t`` optimizer steps after the warm-up: ``min(1/K, sqrt(ln K / (K t)))``."""
        k = self._k
        return 1.0 / k if t == 0 or k == 1 else min(1.0 / k, float(np.sqrt(np.log(k) / (k * t))))

    def step_size(self, tokens: int) -> float:
        """DoReMi's ``η_t`` for an update over ``tokens`` tokens (see the module docstring)."""
        return self.eta if self.eta_tokens is None else self.eta * tokens / self._k / self.eta_tokens

    def _update(self, mean_loss: np.ndarray, seen: np.ndarray, tokens: int) -> None:
        self._updates += 1
        if self.rule == "odm":
            gain = np.exp(np.minimum(mean_loss[seen], 700.0))
            first = seen & np.isnan(self._reward)
            self._reward[first] = gain[first[seen]]
            again = seen & ~first
            self._reward[again] = self.beta * self._reward[again] + (1 - self.beta) * gain[again[seen]]
            reward = np.where(np.isnan(self._reward), np.nanmean(self._reward), self._reward)
            reward = np.where(self._present, reward, 0.0)
            eps = self.epsilon_t(self.steps_since_warmup())
            w = (1 - self._k * eps) * reward / reward.sum() + eps
        else:
            self._excess = np.where(seen, np.maximum(mean_loss - self.reference_losses, 0.0), self._excess)
            with np.errstate(divide="ignore"):  # a weight of exactly 0 (epsilon=0) stays 0
                z = np.where(self._present, np.log(self._pi) + self.step_size(tokens) * self._excess, -np.inf)
            soft = np.exp(z - z.max())
            w = (1 - self.epsilon) * soft / soft.sum() + self.epsilon / self._k
        self._pi = np.where(self._present, w, 0.0)
        self._pi /= self._pi.sum()
        self._pi_sum += self._pi

    # -- drawing ------------------------------------------------------------------------------
    def weights(self) -> np.ndarray:
        return self._pi.copy()

    def _draw(self, lane: int) -> np.ndarray:
        if self._steps_observed < self.warmup_steps:  # warm-up: ClusterClip/uniform rounds over the clusters
            return super()._draw(lane)
        rng = np.random.default_rng([self.seed, _DYNAMIC_STREAM, self._blocks])
        return self._iid_documents(rng, self._pi, self.block_size)

    def telemetry(self, since: np.ndarray | None = None) -> dict[str, float]:
        out = super().telemetry(since)
        out["updates"] = float(self._updates)
        if self.rule == "odm":
            out["epsilon"] = self.epsilon_t(self.steps_since_warmup())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pi": self._pi.copy(), "reward": self._reward.copy(),
                "excess": self._excess.copy(), "updates": self._updates, "steps_observed": self._steps_observed,
                "window_loss": self._window_loss.copy(),
                "window_tokens": self._window_tokens.copy(), "rule": self.rule, "pi_sum": self._pi_sum.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._pi = np.asarray(state["pi"], dtype=np.float64).copy()
        self._reward = np.asarray(state["reward"], dtype=np.float64).copy()
        self._excess = np.asarray(state.get("excess", np.zeros(self.num_clusters)), dtype=np.float64).copy()
        self._updates = int(state["updates"])
        self._steps_observed = int(state["steps_observed"])
        self._window_loss = np.asarray(state["window_loss"], dtype=np.float64).copy()
        self._window_tokens = np.asarray(state["window_tokens"], dtype=np.int64).copy()
        self._pi_sum = np.asarray(state.get("pi_sum", np.zeros(self.num_clusters)), dtype=np.float64).copy()
