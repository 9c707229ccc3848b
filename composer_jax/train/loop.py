"""The continued-pretraining loop: phases, evaluation, metrics, checkpoints, resumption.

A run is a pure function of (config, seed): the data order is seeded, the train state is restored
bit-exactly with the data iterator's position, so a killed run that is started again continues with
the same losses it would have had. A non-finite loss stops the run before anything bad is saved.

A run's folder (`cfg.workdir`, local or `gs://`) holds config.json, launches.jsonl, metrics.jsonl,
tensorboard/ (and trackers.json, wandb/, mlruns/ with other `log.trackers`), checkpoints/<step>/
and, unless it uses the byte tokenizer, tokenizer/ (all opened through `RunFolder`); `load_run`
reads it back, and starting the same config on it again resumes. On several processes every one reads the same global batches and
places its own rows (`_global_batch`); process 0 alone writes the config, launches, metrics and
tokenizer, every process its checkpoint shards, and a signal on any process stops all of them at
the same step (`StopRequest.agreed`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from composer_jax import config as config_lib
from composer_jax import data as data_lib
from composer_jax import optim
from composer_jax.data.sft import make_sft_iterator
from composer_jax.data.tokenizer import check_vocab
from composer_jax.model.layers import logical_axes_of
from composer_jax.model.transformer import Transformer, param_rngs
from composer_jax.parallel import Layout, make_layout
from composer_jax.parallel.mesh import with_shardings
from composer_jax.parallel.packing import balanced_row_order
from composer_jax.parallel.report import sharding_table
from composer_jax.train.checkpoint import CheckpointError
from composer_jax.train.metrics import MetricsWriter
from composer_jax.train.run_folder import RunFolder
from composer_jax.train.step import TrainState, eval_step, init_train_state, split_model, train_step
from composer_jax.train.trackers import check_trackers, run_params


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient; the last good checkpoint is kept."""


@dataclasses.dataclass
class PretrainResult:
    final_step: int
    eval_nll_start: float | None
    eval_nll_end: float | None
    workdir: str
    interrupted: str | None = None  # the signal that stopped the run early, if any


def state_shardings(abstract_state: TrainState, layout: Layout) -> TrainState:
    """Shardings for the whole train state from the parameters' logical axis names.

    Optimizer-state subtrees shaped like the parameters (Adam moments) take the parameters'
    shardings; everything else (counters) is replicated.
    """
    param_sh = layout.tree_shardings(logical_axes_of(abstract_state.params), abstract_state.params)
    buffer_sh = layout.tree_shardings(
        logical_axes_of(abstract_state.buffers), abstract_state.buffers
    )
    replicated = NamedSharding(layout.mesh, P())
    opt_sh = optim.shard_like_params(
        abstract_state.opt_state, abstract_state.params, param_sh, replicated
    )
    return TrainState(replicated, param_sh, buffer_sh, opt_sh)


class StopRequest:
    """SIGTERM / SIGINT handler: the loop stops at the next step boundary and saves; a second
    signal stops at once."""

    def __init__(self):
        self.signal: str | None = None
        self._previous = {}

    def __call__(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def agreed(self) -> str | None:
        """The stop as every process of the job sees it. Processes get a signal at different
        steps (a scheduler's SIGTERM reaches each host on its own), and one that stopped to save
        alone would wait in the checkpoint's collectives while the others wait in the next
        step's: so at every step boundary they share their signals and all stop if any has one."""
        if jax.process_count() == 1:
            return self.signal
        mine = signal.Signals[self.signal].value if self.signal else 0
        seen = int(np.max(multihost_utils.process_allgather(np.int32(mine))))
        if not seen:
            # Not `self.signal`: a signal that arrives while this process waits in the exchange
            # (its handler runs as the exchange returns) was not sent to the others, who go on.
            # It is shared at the next boundary.
            return None
        if self.signal is None:
            self.signal = signal.Signals(seen).name
        return signal.Signals(seen).name


SFTExamples = Callable[[data_lib.Tokenizer], list]


def open_corpus(cfg: config_lib.ExperimentConfig) -> tuple:
    """(train, eval) documents of `data.corpus_root` (the package's own code by default); a
    ConfigError naming the field for a source that cannot be read."""
    root = cfg.data.corpus_root or data_lib.default_code_root()
    kwargs = dict(
        extensions=tuple(cfg.data.extensions),
        eval_fraction=cfg.data.eval_fraction,
        text_field=cfg.data.text_field,
    )
    try:
        return tuple(data_lib.open_documents(root, split, **kwargs) for split in ("train", "eval"))
    except ValueError as error:
        raise config_lib.ConfigError(f"data.corpus_root: {error}") from None


class _Corpora:
    """Train/eval documents, the tokenizer and the SFT examples, built once per run."""

    def __init__(self, documents: tuple, tokenizer, sft_examples: SFTExamples | None = None):
        self.train, self.eval = documents  # `open_corpus`
        self.tokenizer = tokenizer
        self._make_sft_examples = sft_examples
        self._sft_examples = None

    @property
    def sft_examples(self) -> list:
        """The examples of SFT phases (`sft_examples(tokenizer)`, made on first use)."""
        if self._sft_examples is None:
            if self._make_sft_examples is None:
                raise config_lib.ConfigError(
                    "train.phases: a phase trains on data.tasks, so run_pretraining needs "
                    "sft_examples (composer_jax.agent.sft_examples(cfg); launch.pretrain and "
                    "launch.rl pass it)"
                )
            self._sft_examples = self._make_sft_examples(self.tokenizer)
        return self._sft_examples


def _phase_of(step: int, bounds) -> int:
    for i, (start, end) in enumerate(bounds):
        if start <= step < end:
            return i
    return len(bounds) - 1


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything a run derives from its config before touching data or checkpoints."""

    cfg: config_lib.ExperimentConfig
    layout: Layout
    bounds: list[tuple[int, int]]  # [start, end) steps of each phase
    schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    graphdef: nnx.GraphDef
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
    shardings: TrainState

    def init_state(self) -> TrainState:
        """A fresh, sharded train state (parameters initialised on device, never on host)."""
        return jax.jit(self._init_fn, out_shardings=self.shardings)()

    def jit_train_step(self, donate: bool = True, microbatches: int = 1):
        """`train_step` over `microbatches` micro-batches (a phase's), jitted with the state's
        and the batch's shardings (state donated)."""
        step = functools.partial(
            train_step,
            self.graphdef,
            self.optimizer,
            self.cfg.model,
            self.cfg.train,
            self.schedule,
            self.layout,
            microbatches=microbatches,
            qk_clip=optim.QKClip.of(self.cfg.optim, self.cfg.model),
        )
        return jax.jit(
            step,
            in_shardings=(self.shardings, self.layout.batch_sharding()),
            out_shardings=(self.shardings, NamedSharding(self.layout.mesh, P())),
            donate_argnums=0 if donate else (),
        )

    def _init_fn(self):
        model = Transformer(self.cfg.model, param_rngs(self.cfg.seed))
        return init_train_state(model, self.optimizer)


def make_train_setup(
    cfg: config_lib.ExperimentConfig, layout: Layout | None = None, *, verbose: bool = True
) -> TrainSetup:
    """The pretraining setup: one learning-rate schedule over the phases of cfg.train. With
    `verbose`, Muon's split of the parameters is printed as the state is built."""
    lengths = config_lib.phase_steps(cfg)
    return make_setup(cfg, layout, lengths, [p.lr_scale for p in cfg.train.phases], verbose)


def make_setup(
    cfg: config_lib.ExperimentConfig,
    layout: Layout | None,
    phase_lengths: list[int],
    lr_scales: list[float],
    verbose: bool = True,
) -> TrainSetup:
    """Shardings, optimizer and schedule of a train state of cfg.model under cfg.optim, the
    schedule running over phases of the given lengths and learning-rate scales."""
    if layout is None:
        layout = make_layout(config_lib.fitted_mesh(cfg, jax.device_count()))
    starts = np.cumsum([0] + phase_lengths[:-1])
    bounds = [(int(s), int(s + n)) for s, n in zip(starts, phase_lengths)]
    schedule = optim.learning_rate_schedule(cfg.optim, cfg.steps, phase_lengths, lr_scales)
    model = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0)))
    graphdef, abstract_params, _ = split_model(model)
    axes = logical_axes_of(abstract_params)
    optimizer = optim.make_optimizer(
        cfg.optim, schedule, axes, layout.tree_shardings(axes, abstract_params), verbose=verbose
    )
    shapes = jax.eval_shape(
        lambda: init_train_state(Transformer(cfg.model, nnx.Rngs(0)), optimizer)
    )
    shardings = state_shardings(shapes, layout)
    abstract = with_shardings(shardings, shapes)
    return TrainSetup(cfg, layout, bounds, schedule, optimizer, graphdef, abstract, shardings)


def initial_state(setup: TrainSetup, pretrained: Transformer | None = None) -> TrainState:
    """A fresh state; every tensor of `pretrained` (a model of the same architecture, e.g. from
    `interop.load_pretrained`) replaces its random initialisation (MTP heads it lacks keep
    theirs and are trained from scratch)."""
    state = setup.init_state()
    if pretrained is None:
        return state
    loaded = nnx.to_pure_dict(nnx.state(pretrained))
    params, buffers = nnx.to_pure_dict(state.params), nnx.to_pure_dict(state.buffers)
    for path, value in jax.tree_util.tree_leaves_with_path(loaded):
        keys = [entry.key for entry in path]
        target = params if _has_path(params, keys) else buffers
        node = target
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    nnx.replace_by_pure_dict(state.params, params)
    nnx.replace_by_pure_dict(state.buffers, buffers)
    return jax.device_put(state, setup.shardings)


def _has_path(tree: dict, keys: list) -> bool:
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def load_trained_model(workdir: str, step: int | None = None) -> tuple[Transformer, int]:
    """The model of a training run's checkpoint (the latest intact one unless `step`)."""
    return _trained_model(RunFolder.open(workdir), step)


def _trained_model(folder: RunFolder, step: int | None) -> tuple[Transformer, int]:
    """The model of `folder`'s checkpoint of `step` (the latest intact one when None), placed
    over every device as FSDP whatever layout trained it."""
    cfg = folder.cfg
    setup = make_train_setup(
        cfg, make_layout(dataclasses.replace(cfg.mesh, replica=1, fsdp=-1, cp=1))
    )
    try:
        if step is None:
            restored = folder.restore_latest(setup.abstract_state, set_aside=False)
            if restored is None:
                raise CheckpointError(f"no checkpoint in {folder.checkpoint_dir}")
            step, state, _ = restored
        else:
            state, _ = folder.restore(step, setup.abstract_state)
    finally:
        folder.close()
    return nnx.merge(setup.graphdef, state.params, state.buffers), step


@dataclasses.dataclass
class Run:
    model: Transformer
    tokenizer: data_lib.Tokenizer
    config: config_lib.ExperimentConfig
    metrics: list[dict]
    step: int


def load_run(workdir: str, step: int | None = None) -> Run:
    """A training run's model (latest checkpoint unless `step`), tokenizer, config and metrics."""
    folder = RunFolder.open(workdir)
    model, step = _trained_model(folder, step)
    check_vocab(folder.tokenizer, model.cfg.vocab_size)
    return Run(model, folder.tokenizer, folder.cfg, folder.metrics(), step)


def run_pretraining(
    cfg: config_lib.ExperimentConfig,
    progress: bool = True,
    pretrained: Callable[[Layout], Transformer] | None = None,
    sft_examples: SFTExamples | None = None,
) -> PretrainResult:
    """Trains (or resumes) the run described by `cfg` in `cfg.workdir`. A fresh run with
    `cfg.init_from` starts from `pretrained(layout)`, the model placed under the run's layout
    (`interop.load_pretrained`: this module knows no checkpoint format); it is not called on a
    resume. Phases on data.tasks train on
    `sft_examples(tokenizer)` (`composer_jax.agent.sft_examples(cfg)`: this module knows no task
    or agent), made once when the first such phase starts."""
    config_lib.validate(cfg, jax.device_count())
    if cfg.init_from and not os.path.isdir(cfg.init_from):
        raise config_lib.ConfigError(f"init_from: {cfg.init_from!r} is not a folder")
    check_trackers(cfg.log)
    documents = open_corpus(cfg)  # before the folder: a corpus that cannot be read costs nothing
    folder = RunFolder.start(cfg)
    setup = make_train_setup(cfg)
    if cfg.print_sharding and jax.process_index() == 0:
        print(sharding_table(setup.abstract_state.params), flush=True)
    try:
        resume_step, state, data_position = _start_state(folder, setup, pretrained)
        if data_position:  # before the start is recorded: a refused one leaves the run as it was
            _check_extension(data_position, resume_step, setup.bounds)
        launch = folder.commit(resume_step, "pretrain")
        run = _Pretraining(setup, folder, documents, state, resume_step, launch, sft_examples)
        eval_start = run.evaluate() if run.step == 0 else None
        if eval_start is not None:
            print(f"step {run.step}: eval NLL {eval_start:.4f} nats/token", flush=True)
        try:
            interrupted = run.train(data_position, progress)
        finally:
            run.writer.close()
    finally:
        folder.close()
    if interrupted:
        print(
            f"Stopped by {interrupted}; step {run.step} is saved in {folder.checkpoint_dir}",
            flush=True,
        )
    elif eval_start is not None and run.eval_end is not None:
        print(nll_summary(cfg, eval_start, run.eval_end), flush=True)
    return PretrainResult(run.step, eval_start, run.eval_end, folder.path, interrupted)


def _start_state(
    folder: RunFolder, setup: TrainSetup, pretrained: Callable[[Layout], Transformer] | None
) -> tuple[int | None, TrainState, dict]:
    """(restored step or None, train state, data position): the folder's latest checkpoint,
    else a fresh state (from `pretrained(layout)` with `init_from`)."""
    cfg = setup.cfg
    restored = folder.restore_latest(setup.abstract_state)
    if restored is not None:
        print(f"Resumed from {folder.checkpoint_dir}/{restored[0]}", flush=True)
        return restored
    if cfg.init_from and pretrained is None:
        raise config_lib.ConfigError(
            "init_from: pass pretrained=functools.partial(interop.load_pretrained, cfg) "
            "(launch.pretrain does)"
        )
    model = pretrained(setup.layout) if cfg.init_from else None
    state = initial_state(setup, model)
    if model is not None:
        print(f"Initialised from {cfg.init_from}", flush=True)
    return None, state, {}


class _Pretraining:
    """One start of a pretraining run: the train state with its jitted steps, data, metrics
    writer and run folder; `train` advances it phase by phase to cfg.steps or a signal."""

    def __init__(
        self,
        setup: TrainSetup,
        folder: RunFolder,
        documents: tuple,
        state: TrainState,
        resume_step: int | None,
        launch: dict | None,
        sft_examples: SFTExamples | None,
    ):
        cfg = self.cfg = setup.cfg
        self.setup, self.folder, self.state = setup, folder, state
        self.is_main = jax.process_index() == 0
        self.step = int(state.step)
        self.last_saved = resume_step
        self.eval_end: float | None = None
        # One jitted step per micro-batch count: phases that share one share its compilations.
        counts = {p.microbatches for p in cfg.train.phases}
        self._step_fns = {m: setup.jit_train_step(microbatches=m) for m in counts}
        self._eval_fn = jax.jit(functools.partial(eval_step, setup.graphdef, setup.layout))
        self.corpora = _Corpora(documents, folder.tokenizer, sft_examples)
        self._eval_batches = _eval_batches(cfg, self.corpora, setup.layout)
        params = run_params(cfg, launch) if self.is_main else None
        self.writer = MetricsWriter(folder.path, resume_step, self.is_main, cfg.log, params=params)

    def evaluate(self) -> float:
        """Held-out NLL per token at the current step, written to the metrics."""
        totals = [self._eval_fn(self.state, b) for b in self._eval_batches]
        tokens = sum(int(t["tokens"]) for t in totals)
        nll = sum(float(t["nll_sum"]) for t in totals) / max(tokens, 1)
        self.writer.write(self.step, {"eval_nll": nll})
        return nll

    def train(self, data_position: dict, progress: bool) -> str | None:
        """Trains to cfg.steps; returns the signal that stopped it first, if any (that step is
        saved). `data_position`: the restored checkpoint's, for the phase it was saved in."""
        bar = tqdm(
            total=self.cfg.steps,
            initial=self.step,
            disable=not (progress and self.is_main),
            desc="pretrain",
            dynamic_ncols=True,
        )
        try:
            with StopRequest() as stop:
                stopping = stop.agreed()  # only the agreed value steers the loop (see `agreed`)
                while self.step < self.cfg.steps and stopping is None:
                    stopping = self._phase(
                        _phase_of(self.step, self.setup.bounds), data_position, stop, bar
                    )
                    data_position = {}
                return stopping
        finally:
            bar.close()

    def _phase(self, phase_index: int, data_position: dict, stop: StopRequest, bar) -> str | None:
        """Trains to the end of the phase (or an agreed stop, returned)."""
        cfg = self.cfg
        iterator = _make_iterator(cfg, self.corpora, phase_index)
        if data_position.get("phase") == phase_index and data_position.get("iterator"):
            data_lib.restore_iterator_from_json(iterator, data_position["iterator"])
        bar.set_description(f"pretrain[{cfg.train.phases[phase_index].name}]")
        phase_end = self.setup.bounds[phase_index][1]
        t0, logged_at, stopping = time.perf_counter(), self.step, None
        while self.step < phase_end and stopping is None:
            batch = _global_batch(next(iterator), self.setup.layout)
            step_fn = self._step_fns[cfg.train.phases[phase_index].microbatches]
            self.state, metrics = step_fn(self.state, batch)
            self.step += 1
            _check_finite(metrics, self.step, self.folder, self.last_saved)
            stopping = stop.agreed()
            bar.update(1)
            step = self.step
            if step % cfg.train.log_every == 0 or step == phase_end:
                seconds = (time.perf_counter() - t0) / (step - logged_at)
                record = self.writer.write(
                    step, {**metrics, "phase": phase_index, "seconds_per_step": seconds}
                )
                bar.set_postfix(loss=f"{record['loss']:.3f}")
                t0, logged_at = time.perf_counter(), step
            if step % cfg.train.eval_every == 0 or step == cfg.steps:
                self.eval_end = self.evaluate()
            if (
                step % cfg.train.checkpoint_every == 0
                or step == phase_end
                or (stopping is not None and self.last_saved != step)
            ):
                _save(self.folder, step, self.state, phase_index, iterator, self.setup.bounds)
                self.last_saved = step
        return stopping


def nll_summary(cfg: config_lib.ExperimentConfig, start: float, end: float) -> str:
    """The closing line: what the eval NLL measures, and why it rose when the run never trained
    on that data (SFT on task solutions only)."""
    line = f"eval NLL (held-out code corpus): start {start:.4f} -> end {end:.4f} nats/token"
    if end > start and all(p.data == "tasks" for p in cfg.train.phases):
        line += (
            "; it rises because this run trains only on task solutions (SFT), never on the "
            "corpus it is measured on"
        )
    return line


def _check_finite(metrics: dict, step: int, folder: RunFolder, last_saved: int | None) -> None:
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        last = (
            f"the last good checkpoint is {folder.checkpoint_dir}/{last_saved}"
            if last_saved is not None
            else "no checkpoint was saved before it"
        )
        raise NonFiniteLossError(
            f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {step}; "
            f"stopping: {last}"
        )


def _save(
    folder: RunFolder, step: int, state: TrainState, phase_index: int, iterator, bounds
) -> None:
    """Saves the state with the data position: the phase, its iterator (at a phase's end too: a
    run extended past its last phase goes on reading where it stopped) and the phases' steps."""
    position = {
        "phase": phase_index,
        "iterator": data_lib.iterator_state_to_json(iterator),
        "bounds": [list(b) for b in bounds],
    }
    folder.save(step, state, position)


def _check_extension(data_position: dict, step: int, bounds) -> None:
    """A resumed run (extended to more steps, its phases' steps recomputed) must keep the steps
    of the phases it trained in, but for the end of the last: a moved phase would read its data
    from the start again, and a step trained in one phase could fall in another."""
    saved = [tuple(b) for b in data_position.get("bounds") or ()]
    if not saved:  # saved before the phases' steps were kept: nothing to compare
        return
    phase, now = data_position["phase"], [tuple(b) for b in bounds]
    start, end = saved[phase]
    if step >= end and phase < len(saved) - 1:  # finished, and the next phase starts at its end
        end_kept = len(now) > phase and now[phase][1] == end
    else:  # the phase the run goes on in: it may end later (or, mid-phase, earlier)
        end_kept = len(now) > phase and now[phase][1] >= step
    if not (end_kept and now[:phase] == saved[:phase] and now[phase][0] == start):
        raise config_lib.ConfigError(
            f"steps: resuming at step {step} with these steps moves the phases the run trained "
            f"in ([start, end) steps {[list(b) for b in saved]} stored, "
            f"{[list(b) for b in now]} now): their data would be read from the start again. "
            "Extend a run only while its phases keep their steps (one phase, or the last "
            "one longer), or start a new run from its checkpoint (--config.init_from)"
        )


def _make_iterator(cfg, corpora: _Corpora, phase_index: int):
    """The phase's global batches; every process reads the same ones (see `_global_batch`)."""
    phase = cfg.train.phases[phase_index]
    kwargs = dict(
        seq_len=phase.seq_len, batch_size=phase.batch_size, seed=cfg.seed * 1000 + phase_index
    )
    if phase.data == "tasks":
        return make_sft_iterator(corpora.sft_examples, corpora.tokenizer, **kwargs)
    return data_lib.make_pretrain_iterator(corpora.train, corpora.tokenizer, **kwargs)


def _eval_batches(cfg, corpora: _Corpora, layout: Layout) -> list[dict]:
    """A fixed held-out set at the first phase's shape, so eval NLL is comparable across the run."""
    phase = cfg.train.phases[0]
    it = data_lib.make_pretrain_iterator(
        corpora.eval,
        corpora.tokenizer,
        seq_len=phase.seq_len,
        batch_size=phase.batch_size,
        seed=12345,
    )
    return [_global_batch(next(it), layout) for _ in range(cfg.train.eval_batches)]


def _global_batch(batch: dict, layout: Layout) -> dict:
    """The global batch as arrays sharded over (replica, fsdp) x cp; each process places only the
    rows (and sequence slices) of its own devices, so the processes' rows are disjoint and
    together the whole batch.

    Every process reads the same global batch (same pipeline and seed) rather than a share of
    the documents: a run's data, and so its losses, do not depend on how many processes share
    it, and any process count resumes any checkpoint's data position (one iterator state). The
    price is that every host tokenizes and packs the whole batch, cheap next to a training step
    at the batch sizes this code base runs. Rows are first ordered so that every data-parallel
    rank gets equal attention work (packed rows hold equal tokens, not equal attention).
    """
    sharding = layout.batch_sharding()
    data_parallel = layout.mesh.shape["replica"] * layout.mesh.shape["fsdp"]
    segment_ids = np.asarray(batch["segment_ids"])
    order = np.arange(segment_ids.shape[0])
    if data_parallel > 1 and segment_ids.shape[0] % data_parallel == 0:
        order = balanced_row_order(segment_ids, data_parallel)
    if "loss_mask" not in batch:  # Pretraining rows: every target counts.
        batch = dict(batch, loss_mask=np.ones_like(segment_ids))
    arrays = {}
    for key in ("tokens", "segment_ids", "positions", "loss_mask"):
        rows = np.asarray(batch[key], np.int32)[order]
        arrays[key] = jax.make_array_from_callback(rows.shape, sharding, rows.__getitem__)
    return arrays
