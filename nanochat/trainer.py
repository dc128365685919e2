"""
The training run, stage by stage: what `python -m scripts.base_train` (pretraining) runs. train() is the run as a
story; Run holds its components and each stage is a method, so a test can call one alone. The optimizer step is
Run.optimizer_step, one block with its robustness hooks as one-line stop_on_* calls.

Data order: the token stream is split into world_size x grad_accum data ranks and micro-step j of process r reads
data rank r*grad_accum + j, so the data of a step depends only on the effective batch: 2 GPUs x 1 accumulation
and 1 GPU x 2 accumulation see the same tokens in every step.
"""

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from nanochat import checkpoint as ckpt
from nanochat.cli import Exit, ExitCode
from nanochat.collectives import RankFailure, raise_if_any_rank_failed, reduce_with_flags, run_on_rank0
from nanochat.common import autocast_for, compute_cleanup, compute_init, describe_error, print0, use_cpu_threads
from nanochat.data.dataloader import data_ranks, training_loaders
from nanochat.data.dataset import DatasetError, corpus_identity
from nanochat.data.tokenizer import RustBPETokenizer, get_token_bytes, get_tokenizer
from nanochat.eval.health import Health
from nanochat.eval.hops_eval import HopsEvalError, evaluate_hops
from nanochat.eval.loss_eval import EvaluationStopped, refinement, validation_bpb
from nanochat.eval.metrics import RESUME_HINT, MetricsError, MetricsLog, format_duration, write_summary
from nanochat.files import WriteError, atomic_write_bytes, check_writable
from nanochat.model.engine import Engine
from nanochat.model.supervision import STATE_DIAGNOSTICS
from nanochat.train import attention, lifecycle, sharding
from nanochat.train.compile import compile_regions
from nanochat.train.config import SAMPLE_PROMPTS, RunConfig, batch_geometry, data_problem
from nanochat.train.depth import train_depth
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import (
    clipped_step,
    lr_multiplier,
    muon_momentum,
    reduce_gradients,
    set_schedule,
    setup_optimizers,
)
from nanochat.train.planning import ema_decay_for, num_iterations_for, peak_flops
from nanochat.train.probe import Probe, format_probe
from nanochat.train.probe import build as build_probe
from nanochat.train.weight_average import WeightAverage


# ---------------------------------------------------------------------------------------------------- the run
class CorpusData:
    """base_train's data: the pretraining corpus's shards. A data source is what train() reads batches from; chat_sft
    passes its conversations (nanochat/data/chat.ChatData), which answer the same calls."""
    sample_prompts = SAMPLE_PROMPTS  # strings, encoded after <|bos|>; a chat source gives token lists

    def problem(self):
        return data_problem()

    def identity(self):
        return corpus_identity()

    def loaders(self, run_config, tokenizer, rank, resume_states, device="cpu"):
        return training_loaders(run_config, tokenizer, rank, resume_states, device)

    def validation(self, tokenizer, B, T, num_tokens, rank, world_size, device="cpu"):
        return None  # validation_bpb reads the corpus's validation rows itself


class Init(NamedTuple):
    """Initial weights for a fresh run (chat_sft: the base checkpoint's): load(model) writes them into the built model,
    record (plain data) goes into every checkpoint's meta.json as init_from."""
    record: dict
    load: object


def train(run_config, data=None, init=None):
    """The run, start to end; returns the step it stopped at. data: the data source (default: the pretraining corpus);
    init: an Init, the weights a fresh run starts from (default: drawn from the seed)."""
    data = data or CorpusData()
    run_dir = ckpt.model_dir(run_config.model_tag)
    check_writable(run_dir)  # a read-only run directory stops here, before any spending
    ddp, rank, local_rank, world_size, device = compute_init(run_config.device_type, run_config.seed)
    if ddp and world_size != run_config.world_size:
        raise Exit(f"internal: parsed for {run_config.world_size} processes, running {world_size}")
    if device.type == "cpu":  # torch's default, every physical core, thrashes beside other work (common.cpu_threads)
        print0(use_cpu_threads(run_config.threads))
    missing = data.problem()
    if missing:
        raise Exit(missing)
    tokenizer = get_tokenizer()
    model_config = {**run_config.model_config, "vocab_size": tokenizer.get_vocab_size()}
    run_lock = lifecycle.RunLock(run_dir, active=rank == 0)  # held until the run ends
    resume, corpus = start_or_resume(run_config, model_config, tokenizer, rank, run_lock, data)

    fsdp = run_config.sharding == "fsdp"  # every block's weights, gradients and optimizer state sharded over the ranks
    if init and fsdp:
        raise Exit("initial weights (chat_sft) load into an unsharded model: run without --sharding=fsdp")
    model = build_model(model_config, device, fsdp, run_config.dtype)
    model.head_chunks = run_config.head_chunks  # the plan's (planning.plan_head)
    if init and not resume:
        init.load(model)  # before the optimizers and the weight average read the weights
    model.train()
    optimizers = build_optimizers(model, run_config, fsdp)
    num_iterations, horizon_source = num_iterations_for(run_config, model)
    warmup_steps = run_config.warmup_steps if run_config.warmup_steps is not None else \
        round(run_config.warmup_ratio * num_iterations)
    print_config(run_config, num_iterations, horizon_source, model, run_config.total_batch_size)
    if resume:
        ckpt.report_schedule_change(resume, (num_iterations, warmup_steps, run_config.warmdown_ratio,
                                        run_config.final_lr_frac), horizon_source)
    no_room = ckpt.disk_room_problem(run_config.model_tag, ckpt.checkpoint_bytes(model), run_config.keep_last)
    if no_room:
        raise Exit(no_room)
    ema = build_weight_average(run_config, model, model_config, device, fsdp, num_iterations)
    start_step, prior_seconds, loader_states = restore(run_config, resume, model, optimizers, ema)
    attention.choose(run_config.attention, model.config, run_config.device_batch_size, device,
                     getattr(torch, run_config.dtype), log=print0)  # before the first step traces any graph
    if run_config.compile:  # the EMA's copy too: it was deep-copied before, and evaluation would run it eager
        for compiled in (model, ema.module) if ema else (model,):
            compile_regions(compiled, run_config.compile_scope)
    loaders, prefetched = open_training_data(run_config, tokenizer, device, rank, loader_states,
                                             first_batch=start_step < num_iterations, data=data)
    token_bytes = get_token_bytes(device=device)
    try:
        run_lock.claim()  # every check passed: from here the run directory is ours, until the run ends
    except lifecycle.RunLockError as e:
        raise Exit(f"cannot {'resume' if resume else 'start'}: {e}")
    if rank == 0:
        ckpt.remove_partial_saves(run_config.model_tag)
    metrics = MetricsLog(run_dir, run_config, rank, start_step if resume else None)
    price_per_hour = (run_config.gpu_hourly_price or 0) * world_size
    backup = ckpt.Backup.location(run_config.backup_dir, run_config.model_tag, run_config.keep_last).start() \
        if run_config.backup_dir and rank == 0 else None

    background = run_config.async_checkpoint and ckpt.can_write_in_background(model)
    # the writer's last write is finished on any way out
    with lifecycle.StopSignals() as signals, ckpt.CheckpointWriter(background) as writer:
        run = Run(run_config=run_config, run_dir=run_dir, model=model, ema=ema, optimizers=optimizers, loaders=loaders,
                  tokenizer=tokenizer, token_bytes=token_bytes, device=device, rank=rank, world_size=world_size,
                  metrics=metrics, control=lifecycle.RunControl(run_config.max_hours, run_config.max_cost,
                                                                run_config.save_every_minutes, prior_seconds,
                                                                price_per_hour, signals),
                  early_stop=early_stop_for(run_config, resume), backup=backup, writer=writer,
                  model_config=model_config, data=data, init_from=init.record if init else None,
                  corpus=corpus, num_iterations=num_iterations, warmup_steps=warmup_steps, start_step=start_step,
                  resuming=resume is not None,
                  peak_flops=peak_flops(run_config.peak_tflops, run_config.device_type, device), prefetched=prefetched,
                  consumed=[loader.state_dict() for loader in loaders],
                  probe=build_probe(run_config.probe, run_config.probe_share, run_config.seed, run_config.probe_docs))

        # at each step boundary save, evaluate and sample when due; then stop, or train one more step
        step, flags = start_step, run.control.agree(device)  # a budget spent or a signal before the first step
        while True:
            stop, flags = run.step_boundary(step, flags)
            if stop or step == num_iterations:
                break
            t0 = time.time()
            try:
                stats, flags, lrm = run.optimizer_step(step)
            except torch.OutOfMemoryError:
                raise Exit(oom_message(run_config), code=ExitCode.OUT_OF_MEMORY)
            except RankFailure as e:  # the training data: nothing of this step was applied
                if run.saved_step != step and not (resume and step == start_step):
                    run.save(step)
                raise Exit(f"{e}. Stopped at step {step}, whose checkpoint is saved: repair the data as above, then "
                           "run the same command with --resume", code=ExitCode.DATA_DAMAGED)
            # no device sync for the clock: the optimizer's kernels still running now are waited for by the next
            # step's sync, so in a steady state dt is a whole step
            dt = time.time() - t0
            step += 1
            lifecycle.tame_garbage_collector(first_step=step == start_step + 1, step=step)
            run.log_step(step, stats, lrm, dt)
        run.finish(step)
    run_lock.release()  # on any other way out, the process's end releases it
    if run.control.exit_code(flags):
        raise Exit(f"stopped at step {step} by {stop}: the checkpoint is saved; continue with the same "
                   f"command and --resume", code=run.control.exit_code(flags))
    return step


@dataclass
class Run:
    """The run's components and the state its stages share, in named attributes; each stage is a method (save,
    step_boundary, evaluate_and_sample, optimizer_step, log_step, finish), so a test can call one alone."""
    run_config: RunConfig
    run_dir: str  # the tag's directory: checkpoints, metrics, summary
    model: torch.nn.Module  # the weights trained (a GPT, sharded under FSDP); the rest see `published`
    ema: WeightAverage | None
    optimizers: list
    loaders: list  # this process's training loaders, one per accumulation step
    tokenizer: RustBPETokenizer
    token_bytes: torch.Tensor  # bytes per token id, for bits per byte
    device: torch.device
    rank: int
    world_size: int
    metrics: MetricsLog
    control: lifecycle.RunControl  # the clock, the budgets and the flags every rank agrees on
    early_stop: lifecycle.EarlyStop
    backup: ckpt.Backup | None  # rank 0's checkpoint uploader
    writer: ckpt.CheckpointWriter  # saves, and what follows each, in the background or at once
    model_config: dict
    corpus: dict  # the data's identity, recorded in every checkpoint
    num_iterations: int
    warmup_steps: int
    start_step: int  # the step this process started (or resumed) at
    resuming: bool
    peak_flops: float | None  # FLOP/s of one device; None: no MFU
    probe: Probe | None = None  # the depth probe
    data: object = None  # the data source (CorpusData, or chat_sft's conversations): validation and sample prompts
    init_from: dict | None = None  # where a fresh run's initial weights came from (chat_sft's base checkpoint)
    prefetched: tuple | None = None  # (inputs, targets) of the next step's first batch, read while the device works
    consumed: list | None = None  # the loaders' positions after the last trained batch: what a checkpoint resumes from
    val_bpb: list | None = None  # the last evaluation's validation bpb per supervision step
    last_eval_step: int | None = None  # the step it measured (None before the first)
    saved_step: int | None = None  # the step of the last checkpoint this process saved
    history: list = field(default_factory=list)  # every step's losses, for the NaN diagnostic
    state_seen: tuple = (None, [])  # (the step logged, its state diagnostics): the last step that measured them
    health: Health = field(default_factory=Health)

    @property
    def published(self):
        return self.ema.module if self.ema else self.model

    @property
    def fsdp(self):
        return self.run_config.sharding == "fsdp"

    def stop_asked(self):
        return self.control.signals.received is not None  # this rank's view: evaluation agrees on it batch by batch

    def step_boundary(self, step, flags):
        """The boundary before step `step` trains: (the reason to stop here or None, the flags all ranks agreed on
        last). A stop agreed before it saves first; the evaluation and samples run when due (not after a signal: its
        grace period is short) and may bring a stop of their own, a signal during them or early stopping."""
        last_step = step == self.num_iterations
        stop = self.control.stop_reason(flags)  # agreed by every rank: a signal or a budget, raised on any of them
        if stop:
            print0(f"{stop} at step {step}: saving and stopping")
        if self.save_due(step, stop, flags):
            self.save(step)  # before evaluation, so a failing eval can never cost the checkpoint
        if not flags["signal"]:
            late_stop = None
            if not self.evaluate_and_sample(step, due=last_step or bool(stop)):
                flags = self.control.agree(self.device)  # the signal that stopped the evaluation, as every rank saw it
                late_stop = f"{self.control.stop_reason(flags)} during the evaluation"
            elif not (stop or last_step):
                late_stop = self.early_stop.reason()
            if late_stop:
                stop = late_stop
                print0(f"{stop} at step {step}: saving and stopping")
                if self.saved_step != step and self.save_due(step, stop, flags):
                    self.save(step)
        if self.saved_step == step:
            self.prune_and_back_up(step)
        return stop, flags

    def save_due(self, step, stop, flags):
        """Whether step's boundary saves: the last step, a stop, --save_every or --save_every_minutes (not at the step
        just resumed from), and a fresh run stopped before its first step."""
        steps_due = bool(self.run_config.save_every) and step % self.run_config.save_every == 0
        return (step > self.start_step and (step == self.num_iterations or bool(stop) or bool(flags["save_time"])
                                            or steps_due)) or (bool(stop) and not self.resuming)

    def save(self, step):
        """Step's checkpoint: the published weights (and the trained ones beside an EMA), the optimizers, the loaders'
        positions and checkpoint_meta; with the validation bpb when it measured this step."""
        meta = checkpoint_meta(self.run_config, self.model_config, self.tokenizer.fingerprint(), self.corpus,
                               self.num_iterations, self.warmup_steps,
                               val_bpb=self.val_bpb if self.last_eval_step == step else None,
                               elapsed_seconds=self.control.elapsed(), early_stop=self.early_stop.state(),
                               cost=self.control.cost(), loader_state=self.consumed[0], init_from=self.init_from)
        try:
            path = self.writer.save(self.run_config.model_tag, step, self.published, self.optimizers, meta,
                                    {"loaders": self.consumed}, self.rank,
                                    train_model=self.model if self.ema else None)
        except ckpt.CheckpointError as e:
            raise Exit(str(e), code=ExitCode.WRITE_FAILED)
        self.control.saved()
        self.saved_step = step
        self.writer.submit(lambda: print0(f"saved checkpoint {path}"))

    def wait_for_checkpoint(self):
        """The checkpoint write in flight finished; its failure stops the run as a failed save does."""
        try:
            self.writer.wait()
        except ckpt.CheckpointError as e:
            raise Exit(str(e), code=ExitCode.WRITE_FAILED)

    def prune_and_back_up(self, step):
        """After a save, on rank 0: the checkpoints beyond --keep_last removed, the new one queued for the backup; once
        its write is done."""
        if self.rank == 0:
            self.writer.submit(lambda: self.prune_and_submit_backup(step))

    def prune_and_submit_backup(self, step):
        removed = ckpt.prune_checkpoints(self.run_config.model_tag, self.run_config.keep_last)
        if removed:
            print0(f"pruned checkpoints at steps {removed} (keeping the last {self.run_config.keep_last} and the "
                   f"best)")
        if self.backup:
            self.backup.submit(step)

    def evaluate_and_sample(self, step, due):
        """Validation bpb and samples, each when due (`due`, or every --eval_every / --sample_every steps). False when
        a signal stopped the evaluation (every rank stopped it at the same batch)."""
        every = lambda n: bool(n) and step % n == 0  # noqa: E731 - --eval_every / --sample_every; 0 = end only
        if (due or every(self.run_config.eval_every)) and not self.evaluate(step):
            return False
        if self.run_config.samples and (due or every(self.run_config.sample_every)):
            self.sample(step)
        return True

    def evaluate(self, step):
        """Validation bpb per supervision step into val_bpb and last_eval_step, logged, counted by early stopping and
        recorded in step's checkpoint if it is saved. False when a signal stopped it."""
        cfg, data = self.run_config, self.data or CorpusData()
        try:
            self.val_bpb, val_state = validation_bpb(self.published, self.tokenizer, cfg, self.device,
                                                     self.rank, self.world_size, self.token_bytes,
                                                     stop=self.stop_asked,
                                                     batches=data.validation(self.tokenizer, cfg.device_batch_size,
                                                                             cfg.max_seq_len, cfg.eval_tokens,
                                                                             self.rank, self.world_size, self.device))
        except EvaluationStopped:
            return False
        if self.val_bpb:
            self.last_eval_step = step
            self.early_stop.record(step, self.val_bpb[-1])
            self.metrics.log({"kind": "eval", "step": step, "val_bpb": self.val_bpb,
                              "val_refinement": refinement(self.val_bpb), "state": val_state})
            if self.rank == 0:  # once step's checkpoint, if it saves one, is written
                self.writer.submit(lambda bpb=self.val_bpb: self.record_checkpoint_bpb(step, bpb))
        if self.probe:
            self.evaluate_probe(step)
        return True

    def record_checkpoint_bpb(self, step, val_bpb):
        if ckpt.list_steps(self.run_config.model_tag)[-1:] == [step]:
            self.metrics.attempt(lambda: update_checkpoint_bpb(self.run_config.model_tag, step, val_bpb))

    def evaluate_probe(self, step):
        """Accuracy by hop count at every supervision step on the probe's documents: printed and logged."""
        n_sup = self.published.config.n_sup_inference
        try:
            result = evaluate_hops(self.published, self.tokenizer, self.probe.eval_documents(), n_sup,
                                   self.run_config.device_batch_size, self.device,
                                   autocast_for(self.run_config.device_type, self.run_config.dtype), self.rank,
                                   self.world_size)
        except (HopsEvalError, RankFailure) as e:  # a probe is a measurement, not a reason to stop the run
            print0(f"WARNING: the depth probe was skipped: {e}")
            return
        print0(format_probe(result, n_sup))
        self.metrics.log({"kind": "probe", "step": step, **result,
                          "longest_hops_by_step": [row[-1] for row in result["accuracy"]]})

    def sample(self, step):
        # DDP: a share per rank, none idle; FSDP: each token gathers from every rank, so all run every prompt to the end
        run_samples(self.published, self.tokenizer, self.run_config, self.metrics, step,
                    (lambda: False) if self.fsdp else self.stop_asked,
                    (0, 1) if self.fsdp else (self.rank, self.world_size), (self.data or CorpusData()).sample_prompts)

    def optimizer_step(self, step):
        """One optimizer step, top to bottom: forward and backward over the micro-batches, one all_reduce carrying the
        losses, the gradient norm and every rank's flags, then the update. Returns (StepStats, flags, lr multiplier).
        Each robustness hook is a one-line stop_on_* call; training data unreadable on any rank raises RankFailure on
        every rank, before the update."""
        cfg, model = self.run_config, self.model
        # a function of the step alone (every rank and micro-batch agrees), under the step-count curriculum's cap
        n_sup = train_depth(model.config, step, cfg.n_sup_warmup, self.num_iterations)
        diagnose = self.diagnoses(step)  # so is this
        sums = torch.zeros(StepStats.size(n_sup), device=self.device)  # on the device until the reduction
        after, data_error = None, None
        try:
            for j, loader in enumerate(self.loaders):  # gradient accumulation: one loader per micro-step
                x, y = self.prefetched if j == 0 else next(loader)
                x, y = self.mix_probe(x, y, step, j)
                with autocast_for(cfg.device_type, cfg.dtype):
                    loss, aux = model.forward_backward(x, y, loss_scale=1 / cfg.grad_accum, n_sup=n_sup,
                                                       diagnostics=diagnose)
                sums += StepStats.pack(loss, aux)  # no .item() here: the host runs ahead of the device
            after = [loader.state_dict() for loader in self.loaders]
            # the next step's first batch, read now, while the device still works through this step's kernels
            self.prefetched = next(self.loaders[0]) if step + 1 < self.num_iterations else None
        except DatasetError as e:  # told to every rank by the reduction below: no rank waits for this one
            data_error = e
        sq_grad_norm = reduce_gradients(self.optimizers)  # every rank, data or not, so the collectives pair up
        # the step's one host sync: losses, gradient norm and every rank's stop/save/data/write flags, in one all_reduce
        values, flags = self.control.reduce(torch.cat([sums / (cfg.grad_accum * self.world_size),
                                                       sq_grad_norm.view(1)]),
                                            data_failed=data_error is not None,
                                            write_failed=self.metrics.failure is not None)
        self.stop_on_write_failure(flags["write"])
        self.stop_on_data_failure(flags["data"], data_error)
        self.consumed = after  # the loaders' positions a checkpoint of this step resumes from
        stats = StepStats.unpack(values, n_sup)
        self.state_seen = (step + 1, stats.state) if diagnose else self.state_seen
        self.stop_on_nan(step, stats)
        lrm = lr_multiplier(step, self.num_iterations, self.warmup_steps, cfg.warmdown_ratio, cfg.final_lr_frac)
        set_schedule(self.optimizers, lrm, muon_momentum(step))
        clipped_step(self.optimizers, stats.grad_norm, cfg.grad_clip)  # skipped when the norm is not finite
        model.zero_grad(set_to_none=True)
        self.stop_on_bad_grad_norm(step, stats.grad_norm)
        if self.ema:
            self.ema.update_parameters(model)
        return stats, flags, lrm

    def diagnoses(self, step):
        """Whether step measures the recursion's state: every --diagnostics_every steps, and the first and last."""
        return step % self.run_config.diagnostics_every == 0 or step in (self.start_step, self.num_iterations - 1)

    def mix_probe(self, x, y, step, micro_step):
        """The micro-batch with the depth probe's hops documents written over some rows, or as it is."""
        if not self.probe:
            return x, y
        return self.probe.mix(x, y, self.tokenizer, step, micro_step, len(self.loaders), self.rank)

    def stop_on_data_failure(self, failed_ranks, error):
        """Every rank stops before the update when any rank could not read its training data."""
        if failed_ranks:
            self.model.zero_grad(set_to_none=True)
            raise_if_any_rank_failed(error, "reading the training data", failed_ranks)

    def stop_on_nan(self, step, stats):
        """A NaN or infinite loss stops the run without saving, leaving a diagnostic beside the checkpoints."""
        if all(math.isfinite(v) for v in stats.losses + [stats.total]):
            return
        path = os.path.join(self.run_dir, f"nan_diagnostic_step{step:06d}.json")
        if self.rank == 0:
            write_nan_diagnostic(path, step, stats.losses, self.history, self.model_config)
        raise Exit(f"loss is NaN/Inf at step {step} (per-step losses {stats.losses}); stopped without saving, the "
                   f"last good checkpoint is untouched. Diagnostic: {path}", code=ExitCode.DIVERGED)

    def stop_on_bad_grad_norm(self, step, grad_norm):
        """A gradient norm that is not finite skipped the update (clipped_step); the run stops there."""
        if not math.isfinite(grad_norm):
            raise Exit(f"gradient norm is {grad_norm} at step {step}: the update was skipped and the run stopped; "
                       f"lower --matrix_lr or use a milder --preset, then --resume", code=ExitCode.DIVERGED)

    def log_step(self, step, stats, lrm, dt):
        """The step's record (losses, state diagnostics, throughput, MFU, memory, time, cost): logged and printed."""
        self.history.append({"step": step, "step_losses": stats.losses})
        self.health.check(step, stats.losses, stats.grad_norm)
        # the batch's tokens per second of this step: under drawn step counts it moves with the steps drawn; MFU
        # counts the FLOPs of the steps this step trained (len(stats.losses)), so it does not
        tok_per_sec = self.run_config.total_batch_size / dt
        flops = estimate_flops(self.model, n_sup=len(stats.losses))
        mfu = flops * tok_per_sec / (self.peak_flops * self.world_size) if self.peak_flops else None
        mem_gb = torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else None
        record = {"kind": "train", "step": step, "loss": stats.losses[-1], "total_loss": stats.total,
                  "step_losses": stats.losses, "refinement": refinement(stats.losses),
                  "state": [[round(v, 5) for v in row] for row in self.state_seen[1]],
                  "state_step": self.state_seen[0], "grad_norm": stats.grad_norm,
                  "lr_multiplier": lrm, "dt": dt, "tok_per_sec": tok_per_sec, "mfu": mfu, "peak_mem_gb": mem_gb,
                  "elapsed_s": self.control.elapsed(), "cost": self.control.cost() or None}
        self.metrics.log(record)
        print0(self.metrics.format_step(record, self.num_iterations))

    def stop_on_write_failure(self, failed_ranks):
        """Every rank stops together once rank 0 could not write the run's files: rank 0 with its one line
        (which file, why, what to do), the others pointing at it."""
        if failed_ranks:
            raise Exit(self.metrics.failure or f"rank {self.rank} stopped with rank 0, which could not write the run's "
                                               f"files (its line says which and why)", code=ExitCode.WRITE_FAILED)

    def finish(self, step):
        """The run's summary (rank 0), the metrics closed and the backup's uploads drained; every rank stops together
        when rank 0 could not write its files."""
        self.wait_for_checkpoint()
        if self.rank == 0 and step > 0:  # a fresh run stopped before its first step has nothing to summarize
            self.metrics.attempt(lambda: write_summary(self.run_dir, self.run_config,
                                                       step, self.control.elapsed(), self.control.price_per_hour,
                                                       self.model, self.tokenizer.fingerprint()))
        self.stop_on_write_failure(reduce_with_flags(torch.zeros(0, device=self.device),
                                                     [self.metrics.failure is not None])[1][0])
        self.metrics.close()
        if self.run_config.backup_dir:  # every rank: the others wait in short collectives while rank 0's uploads drain
            run_on_rank0(self.backup.close if self.backup else None, self.rank)


def checkpoint_meta(run_config, model_config, tokenizer_fingerprint, corpus, num_iterations, warmup_steps, val_bpb,
                    elapsed_seconds, early_stop, cost, loader_state, init_from=None):
    """A checkpoint's meta.json: what resuming checks (model config, batch geometry, sharding, tokenizer, data),
    continues (the schedule, the clock, early stopping's count) and reports (the flags, validation bpb, cost, and
    init_from: the checkpoint a fine-tuning run started from)."""
    return {**({"init_from": init_from} if init_from else {}),
            "model_config": model_config, "config_sources": run_config.config_sources, "user_flags": run_config.argv,
            "train_config": {k: v for k, v in asdict(run_config).items()
                             if k not in ("model_config", "config_sources")},
            "batch_geometry": batch_geometry(run_config), "num_iterations": num_iterations,
            "warmup_steps": warmup_steps,
            "tokenizer_fingerprint": tokenizer_fingerprint, "data": corpus, "val_bpb": val_bpb,
            "elapsed_seconds": elapsed_seconds, "early_stop": early_stop, "cost": cost, "dataloader": loader_state}


# ---------------------------------------------------------------------------------------------------- its stages
def build_model(model_config, device, fsdp, dtype):
    """The model; under --sharding=fsdp sharded before its weights exist, each weight then drawn whole on the CPU
    (every rank alike, from the seed: the weights the unsharded model gets there) and only each rank's rows kept on
    the device, so neither the device nor host memory ever holds the whole model. Sharded weights are gathered in bf16
    on GPUs for a bf16 run (dtype: --dtype); a float32 run keeps them float32."""
    if not fsdp:
        return ckpt.build_model(model_config, device)
    param_dtype = torch.bfloat16 if device.type == "cuda" and dtype == "bfloat16" else None
    return sharding.build_sharded_model(model_config, device, param_dtype)


def build_optimizers(model, run_config, fsdp):
    """The model's optimizers at the flags' learning rates (times --lr_scale); under FSDP, stepping the shards."""
    optimizers = setup_optimizers(model, unembedding_lr=run_config.unembedding_lr * run_config.lr_scale,
                                  embedding_lr=run_config.embedding_lr * run_config.lr_scale,
                                  matrix_lr=run_config.matrix_lr * run_config.lr_scale,
                                  weight_decay=run_config.weight_decay)
    return sharding.on_shards(optimizers) if fsdp else optimizers


def build_weight_average(run_config, model, model_config, device, fsdp, num_iterations):
    """The EMA of the trained weights, or None when off: the EMA's copy of the model is what evaluation, samples and
    checkpoints see, while training goes on in `model`."""
    ema_decay = ema_decay_for(run_config.ema_decay, num_iterations)
    ema = WeightAverage(model, ema_decay, build_model(model_config, device, fsdp, run_config.dtype) if fsdp
                        else None) if ema_decay else None
    print0("weights published (evaluated, sampled, saved): "
           + (f"EMA with decay {ema_decay:.4f} (--ema_decay={run_config.ema_decay})" if ema
              else "the trained weights"))
    return ema


def restore(run_config, resume, model, optimizers, ema):
    """(the step to start at, the seconds already spent, each loader's position): a fresh run's, or the resume
    point's, whose weights, optimizer state and weight average are loaded in place."""
    if not resume:
        return 0, 0.0, [None] * run_config.grad_accum
    start_step, prior_seconds = resume.step, resume.meta["elapsed_seconds"]
    try:
        loader_states = ckpt.restore(resume, model, optimizers, ema)
    except ckpt.CheckpointError as e:  # a shard refused or damaged: on every rank, DCP's load agrees
        raise Exit(f"cannot resume: {e}")
    print0(f"resumed {run_config.model_tag} from step {start_step} ({format_duration(prior_seconds)} already spent)")
    return start_step, prior_seconds, loader_states


def open_training_data(run_config, tokenizer, device, rank, loader_states, first_batch, data=None):
    """This process's training loaders (one per accumulation step, at their resume positions) and the first batch;
    data unreadable on any rank stops every rank with one line. data: the data source (default: the corpus)."""
    loaders, prefetched, error = [], None, None
    try:
        loaders = (data or CorpusData()).loaders(run_config, tokenizer, rank, loader_states, device)
        prefetched = next(loaders[0]) if first_batch else None
    except DatasetError as e:
        error = e
    try:
        raise_if_any_rank_failed(error, "reading the training data")
    except RankFailure as e:
        raise Exit(str(e), code=ExitCode.DATA_DAMAGED)
    return loaders, prefetched


def print_config(run_config, num_iterations, horizon_source, model, tokens_per_step):
    print0(f"model config ({run_config.model_tag}):")
    for name, value in model.config.to_dict().items():
        print0(f"  {name:26s} = {value!s:14s} ({run_config.config_sources.get(name, 'tokenizer')})")
    print0(f"parameters: {model.num_params():,}   FLOPs per token (training step of {model.config.n_sup_train} "
           f"supervision steps): {estimate_flops(model):.3e}")
    print0(f"batch: {run_config.world_size} processes x {run_config.device_batch_size} x {run_config.max_seq_len} "
           f"tokens x {run_config.grad_accum} accumulation = {tokens_per_step:,} tokens per step, rows of "
           f"{'whole documents' if run_config.rows == 'documents' else 'the token stream'} (--rows)")
    for note in run_config.batch_notes:
        print0(f"  {note}")
    if not run_config.samples:
        print0("samples: off, the corpus is a generated one (python -m nanochat.dataset --synthetic), where the "
               "English sample prompts mean nothing")
    print0(f"horizon: {num_iterations} steps ({horizon_source}), {num_iterations * tokens_per_step:,} tokens")


def start_or_resume(run_config, model_config, tokenizer, rank, run_lock, data=None):
    """(the resume point (step, meta, weights, rank state), checked against this run, or None for a fresh run, on a
    tag that holds no other run (--overwrite moves one aside); the data's identity). A live run on the tag refuses us
    first (run_lock holds the tag's lock from here); every check passes before anything is written."""
    resuming = run_config.resume or run_config.resume_from_step is not None
    try:
        run_lock.hold_existing()
        data = data or CorpusData()
        corpus = data.identity()
        if run_config.backup_dir:
            ckpt.Backup.location(run_config.backup_dir, run_config.model_tag)  # a bad URL stops here, not after a save
        if not resuming:
            found = ckpt.check_fresh_start(run_config.model_tag, run_config.overwrite, run_config.backup_dir)
            if run_config.overwrite:  # on every rank, so the ranks wait for rank 0's move together
                error = None
                if rank == 0 and found:
                    try:
                        moved = ckpt.move_aside(run_config.model_tag)
                        print0(f"--overwrite: moved the previous run ({found}) to {moved}")
                    except OSError as e:
                        error = e
                raise_if_any_rank_failed(error, "moving the previous run aside")
            return None, corpus
        if run_config.backup_dir:
            run_lock.claim()  # restoring from the backup writes into the directory
        which = run_config.resume_from_step if run_config.resume_from_step is not None else "latest"
        point = ckpt.load_resume_point(run_config.model_tag, which, rank, run_config.backup_dir, run_config.world_size,
                                  data_ranks(rank, run_config.grad_accum))
        step, meta = point.step, point.meta
        ckpt.check_tokenizer(meta, tokenizer, f"checkpoint {run_config.model_tag} step {step}")
        ckpt.check_data(meta, corpus, run_config.allow_data_change, f"checkpoint {run_config.model_tag} step {step}")
        diffs = ckpt.resume_differences(meta, model_config, batch_geometry(run_config), run_config.sharding)
        if diffs:
            raise Exit(f"cannot resume {run_config.model_tag} from step {step}: the checkpoint was written with a "
                       f"different configuration:\n  " + "\n  ".join(diffs) +
                       "\nPass the checkpoint's values, or start a new run with another --model_tag.")
        ckpt.check_data_positions(point, run_config, rank, tokenizer, data.loaders)  # the geometry matches by now
    except (ckpt.CheckpointError, RankFailure, DatasetError, lifecycle.RunLockError) as e:
        raise Exit(f"cannot {'resume' if resuming else 'start'}: {e}")
    return point, corpus


def early_stop_for(run_config, resume):
    """--early_stop's counter: continued from the checkpoint resumed (older checkpoints: from the tag's best recorded
    validation bpb, counting anew)."""
    if resume is None:
        return lifecycle.EarlyStop(run_config.early_stop)
    if resume.meta.get("early_stop"):
        return lifecycle.EarlyStop(run_config.early_stop, resume.meta["early_stop"])
    recorded = ckpt.readable_bpb(run_config.model_tag)
    best = ckpt.best_of(recorded)
    return lifecycle.EarlyStop(run_config.early_stop, best_recorded=None if best is None else (best, recorded[best]))


class StepStats(NamedTuple):
    """One optimizer step's numbers, averaged over micro-steps and ranks: the total (weighted) loss, every
    supervision step's loss, the recursion's state diagnostics per step (supervision.STATE_DIAGNOSTICS) and the
    gradient norm. They travel packed in one tensor, so the step reads the device once."""
    total: float
    losses: list
    state: list
    grad_norm: float

    @staticmethod
    def size(n_sup):
        return 1 + n_sup + len(STATE_DIAGNOSTICS) * n_sup  # the gradient norm is appended after the reduction

    @staticmethod
    def pack(loss, aux):
        """aux["state"] is None on a step that does not measure it: zeros travel in its place."""
        state = aux["state"] if aux["state"] is not None else aux["step_losses"].new_zeros(
            len(aux["step_losses"]), len(STATE_DIAGNOSTICS))
        return torch.cat([loss.view(1), aux["step_losses"], state.flatten()]).float()

    @classmethod
    def unpack(cls, values, n_sup):
        width = len(STATE_DIAGNOSTICS)
        state = values[1 + n_sup:-1]
        return cls(values[0], values[1:1 + n_sup], [state[width * s:width * (s + 1)] for s in range(n_sup)],
                   math.sqrt(values[-1]) if values[-1] >= 0 else float("nan"))


def write_nan_diagnostic(path, step, losses, history, model_config):
    record = {"step": step, "step_losses": losses, "last_good": history[-5:], "model_config": model_config,
              "advice": "Lower --matrix_lr (2x), use a milder --preset (extreme -> aggressive), keep --grad_clip=1.0,"
                        " and resume from the last good checkpoint with --resume."}
    atomic_write_bytes(path, json.dumps(record, indent=2).encode())


def oom_message(run_config):
    smaller = max(1, run_config.device_batch_size // 2)
    accum = run_config.grad_accum * run_config.device_batch_size // smaller
    return (f"CUDA out of memory at --device_batch_size={run_config.device_batch_size}, "
            f"--max_seq_len={run_config.max_seq_len}, --depth={run_config.depth}. Lower --device_batch_size (e.g. "
            f"{smaller}) with --gradient_accumulation_steps={accum} to keep the same effective batch; or lower "
            f"--max_seq_len or --depth; or turn on "
            f"--activation_checkpointing"
            + ("" if run_config.model_config["detach_between_steps"] else
               ", or --detach_between_steps (one supervision step's activations alive at a time)") + ".")


STOPPED = "stopped"  # a share's problem when a stop signal cut it short; otherwise the error that failed it


def run_samples(model, tokenizer, run_config, metrics, step, stop, share=(0, 1), prompts=SAMPLE_PROMPTS):
    """Greedy completions of prompts (strings, or token lists such as chat prompts), printed and logged (rank 0);
    skipped, with one line saying why, when a stop signal cut a share short (checked token by token; the stop itself
    is agreed at the next step's reduction) or a share failed. share=(index, count): this process generates prompts
    index, index + count, ... and, with count > 1, every rank's share is gathered: call it on the count ranks
    together."""
    index, count = share
    mine = sample_share(model, tokenizer, run_config, prompts[index::count], stop)
    shares = [mine] if count == 1 else gather_shares(mine, count)  # every rank, stopped or failed too: none waits
    completions, problem = merge_shares(shares, len(prompts))
    if problem:
        print0(problem)
        return
    labels = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
    for label, completion in zip(labels, completions):
        print0(f"sample: {label!r} -> {completion!r}")
    metrics.log({"kind": "sample", "step": step, "samples": list(zip(labels, completions))})


def sample_share(model, tokenizer, run_config, prompts, stop):
    """Greedy completions of prompts: (completions, None), or (None, STOPPED) once stop() is true, or (None, the
    error that failed them)."""
    if not prompts:
        return [], None  # more ranks than prompts
    try:
        model.eval()
        engine = Engine(model, tokenizer, autocast=lambda: autocast_for(run_config.device_type, run_config.dtype))
        outputs = [[] for _ in prompts]
        for column in engine.generate([engine.encode_prompt(p) if isinstance(p, str) else p for p in prompts],
                                      max_tokens=run_config.sample_tokens, temperature=0):
            if stop():
                return None, STOPPED
            for output, token in zip(outputs, column):
                if token is not None:
                    output.append(token)
        return [tokenizer.decode(ids) for ids in outputs], None
    except Exception as e:  # noqa: BLE001 - a sample is a courtesy, not a reason to stop
        return None, describe_error(e)
    finally:
        model.train()


def gather_shares(mine, count):
    """Every rank's sample_share result, in rank order (a collective)."""
    shares = [None] * count
    torch.distributed.all_gather_object(shares, mine)
    return shares


def merge_shares(shares, num_prompts=len(SAMPLE_PROMPTS)):
    """The ranks' (completions, problem), prompt i's on rank i % len(shares) -> (every completion in prompt order,
    None), or (None, the line that says why the samples were skipped)."""
    if any(problem == STOPPED for _, problem in shares):
        return None, "samples abandoned: a stop signal arrived"
    failed = [(rank, problem) for rank, (_, problem) in enumerate(shares) if problem]
    if failed:
        causes = "; ".join(problem if len(shares) == 1 else f"on rank {rank}: {problem}" for rank, problem in failed)
        return None, f"WARNING: sampling failed and was skipped: {causes}"
    return [shares[i % len(shares)][0][i // len(shares)] for i in range(num_prompts)], None


def update_checkpoint_bpb(model_tag, step, val_bpb):
    path = os.path.join(ckpt.step_dir(model_tag, step), "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta["val_bpb"] = val_bpb
    atomic_write_bytes(path, json.dumps(meta, indent=2).encode(), RESUME_HINT)


def run_or_exit(prog, run):
    """An entry point's run: run(), then the process group torn down together; a run's one-line failure (Exit, a
    metrics or checkpoint write error) printed as `prog: ...` and the process exits with its code."""
    try:
        run()
    except (Exit, MetricsError, WriteError) as e:
        sys.stderr.write(f"{prog}: {e}\n")  # one write: the line and its newline stay together beside other ranks
        sys.stderr.flush()
        compute_cleanup()
        sys.exit(getattr(e, "exit_code", ExitCode.FAILED))
    compute_cleanup(together=True)
