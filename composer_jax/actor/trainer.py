"""The trainer role: jitted RL steps on finished groups, orbax checkpoints, weight publishing.

The policy's train state (fp32 master weights, optimizer moments) is sharded by the experiment's
layout exactly like pretraining's; the reference policy of the KL term is the warm-start model,
kept frozen. Each step publishes the new weights to the sampler through the compressed-delta
store in the background (`WeightPublisher.publish_async`), so the trainer never waits for it.

On several JAX processes the train state spans all of them, but only process 0 runs the actor
loop. Its trainer sends each call that involves the state (step, publish, save, the model for
evaluation, close) as a command through a `LeaderChannel`; every other process runs `follow`,
which performs the same calls in the same order, so their collectives meet. A step's command
carries the packed batch: every process places its own rows of it (`place_global`) and, unless
some process has a stop signal (`StopRequest.agreed`), runs the same jitted step. Each process
publishes its own shards of the weights; the sampler waits for all of them. An error on process 0
sends "abort", which ends the others (`ProcessZeroFailed`) instead of leaving them waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import config as config_lib
from composer_jax.config import RLConfig, RLObjectiveConfig
from composer_jax.model.transformer import Transformer
from composer_jax.optim import QKClip
from composer_jax.parallel import Layout, make_layout
from composer_jax.parallel.mesh import BATCH_AXES, use_layout
from composer_jax.parallel.multihost import LeaderChannel, host_model, place_global
from composer_jax.rl.batch import TrajectoryBatch
from composer_jax.rl.policy import reference_logits, reference_logprobs, rl_loss
from composer_jax.trace import NULL_TRACER
from composer_jax.train.loop import StopRequest, TrainSetup, make_setup
from composer_jax.train.run_folder import RunFolder
from composer_jax.train.step import TrainState, apply_gradients
from composer_jax.weight_sync import WeightPublisher, open_store


class NonFiniteRLLossError(FloatingPointError):
    """An RL step produced a NaN/Inf loss or gradient; nothing from it was saved or published."""


class ProcessZeroFailed(RuntimeError):
    """Raised on the other processes of a multi-process run when process 0 stopped on an error
    (its message says which); they exit instead of waiting for commands that will not come."""


def rl_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    objective: RLObjectiveConfig,
    schedule: optax.Schedule,
    layout: Layout | None,
    state: TrainState,
    batch: TrajectoryBatch,
    reference: jax.Array | None,
    qk_clip: QKClip | None = None,
    temperature: float = 1.0,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One policy-gradient step (the gradient step pretraining uses, on the RL loss). Expert
    routing biases are left alone: routing is replayed. `reference`: what `_reference` gives
    (the reference's logits for the exact KL, else its token log-probs), or None.
    `temperature`: the sampler's, whose distribution is the policy trained (see `composer_jax.rl.policy`)."""
    exact = objective.kl_estimator == "exact"
    ref_logprobs, ref_logits = (None, reference) if exact else (reference, None)
    params, opt_state, metrics = apply_gradients(
        graphdef,
        optimizer,
        schedule,
        layout,
        state,
        lambda m: rl_loss(m, batch, objective, ref_logprobs, ref_logits, temperature),
        qk_clip,
    )
    # A non-finite step leaves the state as it was (the caller raises): the old state's buffers
    # are donated, so the kept copy has to come out of the step.
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    new = TrainState(state.step + 1, params, state.buffers, opt_state)
    kept = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, state)
    return kept, metrics


def rl_objective(rl: RLConfig) -> RLObjectiveConfig:
    """The objective the trainer optimises: `rl.objective` with its loss normaliser fixed for the
    run (groups_per_step * group_size * max_generation_len unless configured), so a step with
    fewer groups (the epoch's last) weighs each token the same as every other step."""
    objective = rl.objective
    normalizer = objective.loss_normalizer or float(
        rl.rollout.groups_per_step * rl.rollout.group_size * objective.max_generation_len
    )
    return dataclasses.replace(objective, loss_normalizer=normalizer)


def _reference(graphdef, layout, exact: bool, temperature: float, params, buffers, batch):
    m = nnx.merge(graphdef, params, buffers)
    with use_layout(layout):
        return (reference_logits if exact else reference_logprobs)(m, batch, temperature)


def rl_setup(cfg: config_lib.ExperimentConfig, layout: Layout | None = None) -> TrainSetup:
    """Shardings and optimizer of the policy's train state: the run's optimizer over one
    schedule of cfg.steps steps."""
    return make_setup(cfg, layout, phase_lengths=[cfg.steps], lr_scales=[1.0])


class RLTrainer:
    """Owns the policy's train state; `step(batch)` applies one update and publishes it.

    `warm_params` / `warm_buffers`: the warm-start policy, which is also the KL reference; the
    train state starts from it (fresh optimizer) unless `<workdir>/checkpoints` has a checkpoint.
    `folder`: the run's folder (`RunFolder.start`), which keeps the checkpoints; by default
    `cfg.workdir` as it is.
    `tracer` records the reference pass, the step and each publication (`composer_jax.trace`).
    """

    def __init__(
        self,
        cfg: config_lib.ExperimentConfig,
        warm_params: nnx.State,
        warm_buffers: nnx.State,
        weight_store: str,
        layout: Layout | None = None,
        tracer=NULL_TRACER,
        channel: LeaderChannel | None = None,
        folder: RunFolder | None = None,
    ):
        self.cfg, self.tracer = cfg, tracer
        self.channel = channel
        self.setup = setup = rl_setup(cfg, layout or make_layout(cfg.mesh))
        self.layout = setup.layout
        mesh = self.layout.mesh
        self.data_parallel = mesh.shape["replica"] * mesh.shape["fsdp"]
        self.reference = (
            jax.device_put(warm_params, setup.shardings.params),
            jax.device_put(warm_buffers, setup.shardings.buffers),
        )
        self.folder = folder or RunFolder(cfg.workdir, cfg)
        restored = self.folder.restore_latest(setup.abstract_state)
        if restored is None:
            # Copies: the train state is donated each step, the reference (and whatever else
            # holds the warm-start arrays, e.g. a sampler) must survive.
            params, buffers = jax.tree.map(lambda x: x.copy(), self.reference)
            opt_state = jax.jit(setup.optimizer.init, out_shardings=setup.shardings.opt_state)(
                params
            )
            self.state = TrainState(
                jax.device_put(np.int32(0), setup.shardings.step), params, buffers, opt_state
            )
            self.restored_step = None
        else:
            self.restored_step, self.state, _ = restored
        self._step_fn = jax.jit(
            functools.partial(
                rl_train_step,
                setup.graphdef,
                setup.optimizer,
                rl_objective(cfg.rl),
                setup.schedule,
                self.layout,
                qk_clip=QKClip.of(cfg.optim, cfg.model),
                temperature=cfg.rl.rollout.temperature,
            ),
            donate_argnums=0,
        )
        exact = cfg.rl.objective.kl_estimator == "exact"
        self._ref_fn = jax.jit(
            functools.partial(
                _reference, setup.graphdef, self.layout, exact, cfg.rl.rollout.temperature
            )
        )
        self.publisher = WeightPublisher(
            open_store(weight_store),
            delta=cfg.rl.weight_delta,
            snapshot_every=cfg.rl.snapshot_every,
        )
        self.last_publish = None

    @property
    def version(self) -> int:
        """The policy version the current weights are: the number of steps applied."""
        return int(self.state.step)

    def _send(self, kind: str, payload=None) -> None:
        """On process 0 of several: have the other processes' `follow` make the same call."""
        if self.channel is not None:
            self.channel.send(kind, payload)

    def publish(self):
        """Queues the current weights as `version` (compress and write in the background)."""
        self._send("publish")
        return self._publish()

    def _publish(self):
        self.last_publish = self.publisher.publish_async(self.state.params, self.version)
        if self.tracer.enabled:
            self.last_publish.add_done_callback(self._trace_publish)
        return self.last_publish

    def _trace_publish(self, future) -> None:
        """The publication's write, on the publisher's thread (its end is now)."""
        if future.exception() is None and not future.result().skipped:
            info, end = future.result(), time.perf_counter()
            self.tracer.complete(
                "publish", f"v{info.version} {info.kind}", end - info.seconds, end, "weight publish"
            )

    def place_batch(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        """Rows over (replica, fsdp) x cp; per-sample arrays and hinted rows replicated."""
        mesh = self.layout.mesh
        rows = NamedSharding(mesh, P(BATCH_AXES, "cp"))
        replicated = NamedSharding(mesh, P())
        router = NamedSharding(mesh, P(None, BATCH_AXES, "cp"))
        teacher = {
            "teacher_tokens_BT",
            "teacher_positions_BT",
            "teacher_segment_ids_BT",
        }

        def sharding_of(path, leaf):
            name = path[0].name  # the TrajectoryBatch field
            if name == "router_indices_LBTK":
                return router
            if name in teacher or np.ndim(leaf) < 2:
                return replicated
            return rows

        shardings = jax.tree_util.tree_map_with_path(sharding_of, batch)
        return place_global(batch, shardings)

    def step(self, batch: TrajectoryBatch, stop=None) -> dict[str, float] | None:
        """One update on a packed batch; raises NonFiniteRLLossError on NaN (state unchanged,
        nothing published). On several processes `stop` (a `StopRequest`) is agreed first: None
        when any process has a signal, and then no process trains."""
        self._send("step", batch)
        return self._step(batch, stop)

    def _step(self, batch: TrajectoryBatch, stop) -> dict[str, float] | None:
        # Every process takes part in the agreement, whether or not its caller passed a `stop`.
        if jax.process_count() > 1 and (stop or StopRequest()).agreed():
            return None
        tracer = self.tracer
        batch = self.place_batch(batch)
        ref = None
        if self.cfg.rl.objective.kl_coef > 0:
            with tracer.span("reference", rows=batch.tokens_BT.shape[0]):
                ref = self._ref_fn(*self.reference, batch)
                if tracer.enabled:  # its own time, not the step's (only when tracing)
                    ref = jax.block_until_ready(ref)
        with tracer.span("train_step", rows=batch.tokens_BT.shape[0]):
            self.state, metrics = self._step_fn(self.state, batch, ref)
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not (np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])):
            raise NonFiniteRLLossError(
                f"RL step {self.version + 1}: loss {metrics['loss']}, grad norm "
                f"{metrics['grad_norm']}; the state is unchanged, the last checkpoint kept"
            )
        with tracer.span("publish_dispatch"):
            self._publish()
        return metrics

    def save(self, metadata: dict) -> None:
        self._send("save", metadata)
        self.folder.save(self.version, self.state, metadata)

    def model(self) -> Transformer:
        """The current policy as a model over the train state's devices."""
        return nnx.merge(self.setup.graphdef, self.state.params, self.state.buffers)

    def host_model(self) -> Transformer:
        """The current policy on this process's devices alone (for evaluation); gathered from
        every process when the state spans several."""
        self._send("host_model")
        return host_model(self.model())

    def close(self, interrupted: str | None = None) -> None:
        """Waits for pending publications and checkpoints; on several processes the others'
        `follow` returns `interrupted` (the signal that stopped the run, if any)."""
        self._send("close", interrupted)
        self.publisher.close()
        self.folder.close()

    def follow(self, stop) -> str | None:
        """Processes other than 0: make process 0's trainer calls until it closes; returns the
        signal that stopped the run (process 0's, or this process's own `stop`), if any."""
        while True:
            if self.last_publish is not None and self.last_publish.done():
                self.last_publish.result()  # re-raises a failed publication of our shards
            kind, payload = self.channel.receive()
            if kind == "step":
                self._step(payload, stop)
            elif kind == "publish":
                self._publish()
            elif kind == "save":
                self.folder.save(self.version, self.state, payload)
            elif kind == "host_model":
                host_model(self.model())
            elif kind == "close":
                self.publisher.close()
                self.folder.close()
                return payload or stop.signal
            elif kind == "abort":
                raise ProcessZeroFailed(f"process 0 stopped on {payload}")
            else:
                raise ValueError(f"unknown trainer command {kind!r} from process 0")
