"""Lightning callbacks of a ccexp run: the sampler's telemetry, the held-out curve, and a recorder of
what each rank trained on."""
from __future__ import annotations

import logging
import signal
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, Timer

from ccexp.sampling import Sampler

log = logging.getLogger("ccexp")


def _ends_step(trainer, batch, every: int) -> bool:
    """True after the last micro-batch of an optimizer step that is a multiple of ``every`` (or the last)."""
    step = trainer.global_step
    return bool(batch["last_micro"]) and (step % every == 0 or step == trainer.max_steps)


class SamplerTelemetry(Callback):
    """Log the policy's telemetry (``sampler/*``: cumulative, and ``window_*`` over the last
    ``every`` steps) every ``every`` optimizer steps, on rank 0; with at most ``max_clusters`` clusters
    also each cluster's exposure (documents drawn so far, ``sampler/exposure/NNNN``), tokens trained
    (``sampler/tokens/NNNN``) and, for weighted policies, its weight (``sampler/weight/NNNN``)."""

    def __init__(self, sampler: Sampler, every: int, max_clusters: int = 64):
        self.sampler, self.every, self.max_clusters = sampler, max(1, int(every)), int(max_clusters)
        self.last_exposure = sampler.exposure()
        self.history_steps: list[int] = []  # cumulative exposure at every logged step, for the balance report
        self.history: list[np.ndarray] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if not (trainer.is_global_zero and _ends_step(trainer, batch, self.every)):
            return
        self.history_steps.append(step)
        self.history.append(self.sampler.exposure())
        if not trainer.loggers:
            return
        metrics = {f"sampler/{k}": v for k, v in self.sampler.telemetry(since=self.last_exposure).items()}
        self.last_exposure = self.sampler.exposure()
        if self.sampler.num_clusters <= self.max_clusters:
            metrics.update({f"sampler/exposure/{c:04d}": float(e) for c, e in enumerate(self.sampler.exposure())})
            metrics.update({f"sampler/tokens/{c:04d}": float(t) for c, t in enumerate(pl_module.cluster_tokens.tolist())})
            weights = self.sampler.weights()
            if weights is not None:
                metrics.update({f"sampler/weight/{c:04d}": float(w) for c, w in enumerate(weights)})
        for logger in trainer.loggers:  # MLflow, and any of logger.loggers (TensorBoard)
            logger.log_metrics(metrics, step=step)


class BatchRecorder(Callback):
    """Save what each rank trained on, micro-batch by micro-batch, to ``<dir>/rank<r>.npz``: ``steps``
    and ``micro`` int64[n], ``rows`` int64[n, m] (the rows' indices among the step's R rows),
    ``input_ids`` and ``doc_ids`` int64[n, m, L] (the sampler document of every input token), and
    ``plan_digest`` int64[n] (a hash of the whole step's plan, which every rank draws), for checking the
    stream across world sizes and resumes."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.records: dict[str, list] = {k: [] for k in ("steps", "micro", "rows", "input_ids", "doc_ids",
                                                         "plan_digest")}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import hashlib

        for key, name in (("steps", "step"), ("micro", "micro"), ("rows", "rows"), ("input_ids", "input_ids"),
                          ("doc_ids", "doc_ids")):
            self.records[key].append(np.asarray(batch[name].cpu() if torch.is_tensor(batch[name]) else batch[name]))
        plan = trainer.datamodule.plans[int(batch["step"])]
        digest = hashlib.blake2b(np.concatenate([plan.doc, plan.start, plan.pos]).tobytes(), digest_size=8)
        self.records["plan_digest"].append(np.frombuffer(digest.digest(), dtype=np.int64)[0])

    def on_train_end(self, trainer, pl_module) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(self.out_dir / f"rank{trainer.global_rank}.npz", **{k: np.stack(v) for k, v in self.records.items()})


class HeldoutCurve(Callback):
    """Held-out perplexity during training: every ``every`` optimizer steps (and before the first),
    score a fixed sample of held-out documents and log ``curve/ppl``, ``curve/ppl_macro``,
    ``curve/ppl_worst`` and ``curve/ppl_<label>/<value>`` with the MLflow step set to the *tokens
    trained*, so runs of different samplers compare on one axis (in TensorBoard and W&B, whose scalars share
    one step axis, at the optimizer step with ``curve/tokens_trained`` beside them). The ranks score shares of the
    sample (a sharded model needs all of them in every forward pass); rank 0 logs. Plain data only, so it pickles into spawned ranks.

    Args:
        every: optimizer steps between evaluations.
        tokens, offsets: the tokenized corpus.
        docs: int64[n] corpus indices of the sample; clusters: int64[n] their clusters (of K).
        labels: label name -> n values (e.g. ``domain``), for per-label perplexity.
        score_args: keyword arguments of [`ccexp.evaluation.perplexity.document_nll`][ccexp.evaluation.perplexity.document_nll] (``eos_id``,
            ``pad_id``, ``max_tokens``, ``batch_size``); min_cluster_docs: for ``ppl_worst``.
    """

    def __init__(self, every: int, *, tokens: np.ndarray, offsets: np.ndarray, docs: np.ndarray, clusters: np.ndarray,
                 num_clusters: int, labels: dict[str, list[str]], score_args: dict[str, int], min_cluster_docs: int,
                 label_names: dict[str, dict[str, str]] | None = None):
        self.every, self.tokens, self.offsets, self.docs = int(every), tokens, offsets, np.asarray(docs, dtype=np.int64)
        self.clusters, self.num_clusters, self.labels = np.asarray(clusters), int(num_clusters), labels
        self.score_args, self.min_cluster_docs = dict(score_args), int(min_cluster_docs)
        self.label_names = label_names  # the corpus-wide value -> name map, so curve names match the final ones
        self.points: list[tuple[int, dict[str, float]]] = []  # (tokens trained, metrics), for plots and tests

    def _evaluate(self, trainer, pl_module) -> None:
        from ccexp.evaluation.perplexity import document_nll, summarize

        # the ranks score shares of the sample; a sharded model through its FSDP root, whose forward gathers the shards
        sharded = type(trainer.strategy.model).__name__ == "FullyShardedDataParallel"
        model = trainer.strategy.model if sharded else pl_module.model
        nll, ntok = document_nll(model, self.tokens, self.offsets, self.docs, device=pl_module.device,
                                 ranks=(trainer.global_rank, trainer.world_size), **self.score_args)
        if not trainer.is_global_zero:
            return
        report = summarize(nll, ntok, self.clusters, self.num_clusters, self.labels, min_cluster_docs=self.min_cluster_docs,
                           label_names=self.label_names)
        metrics = {k: v for k, v in report.metrics.items()
                   if k in ("ppl", "ppl_macro", "ppl_worst") or "/" in k and not k.startswith("ppl_cluster/")}
        tokens = pl_module.tokens_seen
        self.points.append((tokens, metrics))
        log.info("curve: step %d, %s tokens: held-out sample ppl %.2f, macro %.2f, worst %.2f", trainer.global_step,
                 f"{tokens:,}", metrics["ppl"], metrics["ppl_macro"], metrics["ppl_worst"])
        from ccexp.names import metric_keys

        curve = metric_keys({f"curve/{k}": v for k, v in metrics.items()})
        for logger in trainer.loggers:  # MLflow at the tokens trained; the others (TensorBoard, W&B) at the optimizer
            if type(logger).__name__ == "MLFlowLogger":  # step, as all their scalars, with the tokens beside
                logger.log_metrics(curve, step=tokens)
            else:
                logger.log_metrics({**curve, "curve/tokens_trained": float(tokens)}, step=trainer.global_step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if _ends_step(trainer, batch, self.every):
            self._evaluate(trainer, pl_module)


class WeightAverage(Callback):
    """Averaged weights of the model, updated after every optimizer step, for a held-out score that
    depends less on the last few batches: the checkpoint-to-checkpoint noise that makes single final
    checkpoints a noisy measure of a data choice (Heineman et al. 2025, "Signal and Noise", §5: average
    over the end of training). ``kind="ema"``: ``w̄ ← d·w̄ + (1 − d)·w`` with ``d = 1 − 1/(span · steps)``
    (an exponential moving average whose time constant is ``span`` of the run); ``kind="tail"``: the
    uniform mean of the weights after each of the last ``ceil(span · steps)`` steps (SWA's average,
    Izmailov et al. 2018, over the tail of the run). The averaging is
    `torch.optim.swa_utils.AveragedModel` over the parameters (not the buffers); its state is
    saved in checkpoints, so a resumed run averages exactly as an uninterrupted one.

    Args:
        kind: ``ema`` or ``tail``; span: the fraction of the run in (0, 1]; total_steps: the run's steps.
    """

    def __init__(self, kind: str, span: float, total_steps: int):
        self.kind, self.span, self.total_steps = kind, float(span), int(total_steps)
        window = max(1, int(np.ceil(self.span * self.total_steps)))
        self.decay = 1.0 - 1.0 / window
        self.first_step = max(1, self.total_steps - window + 1) if kind == "tail" else 1  # 1-based optimizer steps
        self.average = None  # AveragedModel of pl_module.model
        self._pending: dict | None = None  # a checkpoint's state, loaded before setup built the average

    @property
    def model(self) -> torch.nn.Module | None:
        """The averaged model (the same class as the trained one), or None before training."""
        return None if self.average is None else self.average.module

    def setup(self, trainer, pl_module, stage: str) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        if stage != "fit" or self.average is not None:
            return
        fn = {"multi_avg_fn": get_ema_multi_avg_fn(self.decay)} if self.kind == "ema" else {}
        self.average = AveragedModel(pl_module.model, use_buffers=False, **fn)
        self.average.requires_grad_(False)
        if self._pending is not None:
            self.average.load_state_dict(self._pending)
            self._pending = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if bool(batch["last_micro"]) and trainer.global_step >= self.first_step:
            self.average.update_parameters(pl_module.model)

    def state_dict(self) -> dict:
        return {} if self.average is None else {"average": self.average.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "average" not in state_dict:
            return
        if self.average is None:
            self._pending = state_dict["average"]
        else:
            self.average.load_state_dict(state_dict["average"])


class StoppedByCallback(BaseException):
    """Raised by [`StopAtStepEnd`][ccexp.training.callbacks.StopAtStepEnd] out of ``trainer.fit`` once the checkpoint of an early stop is saved
    (the runner catches it): letting Lightning end the epoch instead would save ``last.ckpt`` again with a
    finished loop, from which no resume continues."""


class StopAtStepEnd(Callback):
    """Let a callback that stops training (``trainer.should_stop``: Lightning's Timer, EarlyStopping) stop only
    at the end of an optimizer step, never mid-accumulation, and — when that is before ``steps`` — save the full
    state to ``path`` right there, mid-epoch (as [`StopOnSignal`][ccexp.training.callbacks.StopOnSignal] does), then leave ``fit`` by
    [`StoppedByCallback`][ccexp.training.callbacks.StoppedByCallback], so that a resume continues on exactly the tokens of an uninterrupted run.
    Remembers which callback asked (`by`) and the step (`stopped_at`). Put it after the callbacks
    it watches. A run that reaches ``steps`` ends with its final state in ``path`` ([`on_train_end`][ccexp.training.callbacks.StopAtStepEnd.on_train_end])."""

    def __init__(self, path: Path, steps: int):
        self.path, self.steps = Path(path), int(steps)
        self.by: str | None = None
        self.stopped_at: int | None = None
        self._pending = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not (trainer.should_stop or self._pending):
            return
        if trainer.should_stop and self.by is None:
            self.by = next((f"callbacks.{type(c).__name__}" for c in trainer.callbacks
                            if getattr(c, "_ccexp_stopped", False)), "a callback")
        if not bool(batch["last_micro"]):
            self._pending, trainer.should_stop = True, False  # finish the optimizer step first
            return
        trainer.should_stop, self._pending = True, False
        if trainer.global_step < self.steps and self.stopped_at is None:
            trainer.save_checkpoint(self.path, weights_only=False)  # the full state, to resume from
            self.stopped_at = int(trainer.global_step)
            raise StoppedByCallback()

    def on_train_end(self, trainer, pl_module) -> None:
        """A run that reached ``steps`` leaves its final state in ``path`` (``last.ckpt``): the periodic
        checkpoints (``train.checkpoint_every_n_steps``) save it only at their own steps, so a run of 12 steps
        saving every 5 left step 10 there."""
        every = trainer.checkpoint_callback
        if every is not None and every.save_last and not getattr(every, "_last_checkpoint_saved", ""):
            return  # nothing saved yet: Lightning's ModelCheckpoint saves last.ckpt at the end itself
        saved = getattr(every, "_last_global_step_saved", None)
        if trainer.global_step >= self.steps and (saved != trainer.global_step or not self.path.exists()):
            trainer.save_checkpoint(self.path, weights_only=False)


class LaunchTimer(Timer):
    """Lightning's `Timer` whose budget is per *launch*: a resumed run gets
    the whole ``duration`` again (Lightning restores the elapsed time from the checkpoint, so a run the timer
    stopped could never continue). Marks itself when it stops training ([`StopAtStepEnd`][ccexp.training.callbacks.StopAtStepEnd] names it)."""

    _ccexp_stopped = False

    def load_state_dict(self, state_dict: dict) -> None:
        """Ignore the saved elapsed time: this launch's budget starts now."""

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        was = trainer.should_stop
        super().on_train_batch_end(trainer, *args, **kwargs)
        if trainer.should_stop and not was:
            self._ccexp_stopped = True


class StopOnSignal(Callback):
    """Stop on SIGTERM (Slurm, Kubernetes) or SIGINT (Ctrl-C) at the end of the current optimizer step,
    never mid-accumulation: the signal only sets a flag; at the step's last micro-batch the ranks agree
    (all-reduce), a checkpoint is saved to ``path`` (mid-epoch, so it resumes like any step
    checkpoint) and [`Interrupted`][ccexp.errors.Interrupted] is raised, naming the checkpoint. A second
    Ctrl-C stops at once, also with [`Interrupted`][ccexp.errors.Interrupted] — never a ``KeyboardInterrupt``,
    on which Lightning would exit with status 1 — naming the newest checkpoint there is (checkpoints
    are written atomically, so the one being written when it came is either whole or absent). A signal
    of [`PASSED_ON`][ccexp.training.callbacks.StopOnSignal.PASSED_ON] that someone listens for when training starts — SIGUSR2, which submitit
    (``hydra/launcher=slurm``) has Slurm send ``signal_delay_s`` before the job's time limit — stops
    training the same way, and [`Interrupted`][ccexp.errors.Interrupted] carries that listener (``pass_on``) for
    the entry point to call once the run is closed: submitit then requeues the job, which continues
    from the checkpoint. The previous handlers come back when training ends."""

    PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self, path: Path):
        self.path = Path(path)
        self.signum = 0
        self.pass_on = None  # the listener of a PASSED_ON signal that came, to call after the run is closed
        self._previous: dict[int, object] = {}
        self._trainer = None

    def _flag(self, signum, frame) -> None:
        self.signum = self.signum or signum
        if signum in self.PASSED_ON:
            self.pass_on = self._previous.get(signum)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, self._at_once)  # a second Ctrl-C interrupts at once
        log.warning("%s received: stopping after this optimizer step and saving a checkpoint%s",
                    signal.Signals(signum).name, " (Ctrl-C again stops at once)" if signum == signal.SIGINT else "")

    def _at_once(self, signum, frame) -> None:
        from ccexp.errors import Interrupted

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one while we unwind changes nothing
        step = self._trainer.global_step if self._trainer is not None else 0
        newest = max(self.path.parent.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, default=None)
        raise Interrupted(signum, f"stopped at once by a second SIGINT during step {step + 1}; " + (
            f"the newest checkpoint is {newest}: run the same command again to continue from it" if newest else
            "no checkpoint had been saved"), step=step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._trainer = trainer
        listened = [s for s in self.PASSED_ON if callable(signal.getsignal(s))]  # submitit's SIGUSR2 in a Slurm job
        for signum in (signal.SIGTERM, signal.SIGINT, *listened):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._flag)  # replaces Lightning's, which would stop mid-accumulation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not bool(batch["last_micro"]):
            return
        flag = torch.tensor([float(self.signum)], device=pl_module.device)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        if flag.item():
            trainer.save_checkpoint(self.path, weights_only=False)  # the full state, to resume from
            from ccexp.errors import Interrupted

            for signum in self._previous:  # stopping now: nothing may cut the closing short
                self._previous[signum] = signal.SIG_IGN
            signum, step = int(flag.item()), trainer.global_step
            if self.pass_on is not None:
                raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} after step {step}, the "
                                          "scheduler's notice of the job's time limit (or of a preemption); the "
                                          f"checkpoint is {self.path}: the requeued job continues from it with "
                                          "train.resume_from=auto (or train.resume_from=last)",
                                  pass_on=self.pass_on, step=step)
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} after step {step}; run the same "
                                      f"command again to continue from {self.path}", step=step)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    # before Lightning's own teardown puts back the handlers it found (callbacks' teardown comes after it)
    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()


class ProgressLog(Callback):
    """A log line every ``every`` optimizer steps and at the last (rank 0): step, tokens trained, the
    step's loss, tokens/s since training started and the time left. Lines go through the ``ccexp``
    logger, so they reach ``ccexp.log`` and a redirected stdout, not only a terminal's progress bar."""

    def __init__(self, every: int):
        self.every = max(1, int(every))
        self._t0, self._step0 = 0.0, 0
        self.tokens_at_start: int | None = None  # tokens trained before this launch (a resumed run's), once it starts

    def on_train_start(self, trainer, pl_module) -> None:
        import time

        self._t0, self._step0, self.tokens_at_start = time.perf_counter(), trainer.global_step, pl_module.tokens_seen

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        if not (trainer.is_global_zero and _ends_step(trainer, batch, self.every)):
            return
        step, total = trainer.global_step, trainer.max_steps
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        done = max(step - self._step0, 1)
        eta = elapsed / done * (total - step)
        log.info("train: step %d/%d (%.0f%%), %s tokens, loss %.4f, %s tokens/s, ETA %s", step, total,
                 100 * step / total, f"{pl_module.tokens_seen:,}", pl_module.last_loss,
                 f"{(pl_module.tokens_seen - self.tokens_at_start) / elapsed:,.0f}", _duration(eta))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


_OWN_KEYS = ("step", "micro", "last_micro", "rows")  # what places a micro-batch in the run: never copied


class RepeatFirstBatch(Callback):
    """``debug=overfit``: every micro-batch trains on the first micro-batch's tokens (copied into it in place
    before the training step; its step and micro-batch counters stay its own), so the training loss shows
    whether the model can fit one batch. The stream still draws its documents; only what is trained changes.
    The repeated micro-batch is part of the checkpoint ([`state_dict`][ccexp.training.callbacks.RepeatFirstBatch.state_dict]), so a resumed run repeats the same
    one, not the first micro-batch after the resume."""

    def __init__(self) -> None:
        self.first: dict[str, torch.Tensor] | None = None

    def state_dict(self) -> dict:
        return {"first": self.first}

    def load_state_dict(self, state_dict: dict) -> None:
        """Repeat the micro-batch the interrupted run repeated (``None``: it had not trained a step yet)."""
        first = state_dict.get("first")
        self.first = None if first is None else {k: v.detach().clone() for k, v in first.items()}

    def on_train_batch_start(self, trainer, pl_module, batch: dict, batch_idx: int) -> None:
        tensors = {k: v for k, v in batch.items() if torch.is_tensor(v) and k not in _OWN_KEYS}
        if self.first is None:
            self.first = {k: v.detach().clone() for k, v in tensors.items()}
            log.info("debug: overfitting one micro-batch of %d rows (%s tokens)", batch["input_ids"].shape[0],
                     f"{batch['input_ids'].numel():,}")
            return
        for key, value in self.first.items():
            tensors[key].copy_(value)
