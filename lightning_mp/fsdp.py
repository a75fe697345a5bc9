"""The plugin in the form Lightning's ``FSDPStrategy`` (torch FSDP1) accepts, for the Trainer and for Fabric.

Lightning's ``FSDPStrategy`` refuses every precision plugin that is not its ``FSDPPrecision`` (the Trainer's and
Fabric's are two classes). :class:`FSDPMixedPrecision` is :class:`~lightning_mp.MixedPrecision` and both of them, built
from the same arguments::

    trainer = Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("16-mixed")])
    fabric = Fabric(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("bf16-mixed")])

Everything else is the plugin's own step engine and loss scaler: autocast, hysteresis, bounds and the collapse
error, skipped-step accounting in bf16, the scheduler held back on a skipped step, telemetry and checkpoints.

How the opt levels map onto FSDP's own mixed precision (:attr:`FSDPMixedPrecision.mixed_precision_config`, which
the strategy hands to ``FullyShardedDataParallel(mixed_precision=...)``):

* ``O1`` (and fp32, ``O0``): FSDP keeps, gathers, reduces and stores everything in fp32 (parameter, reduce and buffer
  dtypes fp32), and autocast casts per op, exactly as under DDP. ``keep_fp32`` modules run outside autocast.
* ``O2``: FSDP's fp32 shards are the master weights, and it gathers half copies of them for the forward and
  backward passes (``param_dtype`` half); the gradients are reduce-scattered in half (``reduce_dtype``), as DDP
  all-reduces O2's half gradients (half the bytes of fp32 on the wire; in fp16 a sum over ranks that overflows is a
  skipped step, as under DDP), and the run matches DDP's; buffers stay fp32. That is O2's design (half weights for
  compute, fp32 masters for the step) done by FSDP itself, so the package's own O2 copies are not made. The inputs
  are not cast to half (``cast_root_forward_inputs=False``): the Trainer sends the whole batch, targets included,
  through the root's forward, and autocast casts each op's inputs.
  Normalisation layers stay fp32 where FSDP wraps them in units of their own (with an ``auto_wrap_policy``, FSDP's
  default). FSDP gathers every weight of a unit in one dtype, so each ``keep_fp32`` module must be a unit of its
  own with an fp32 policy: :meth:`FSDPMixedPrecision.auto_wrap_policy` builds the strategy's ``auto_wrap_policy``
  that makes them (torch's public ``CustomPolicy``, whose per-module keyword arguments override the policy), and a
  ``keep_fp32`` module that is not such a unit is refused by name (at the Trainer's setup, at Fabric's first
  forward).
* ``lean-exact`` (bf16) runs as ``O2``: its contract is O2's numbers with 4 bytes of weight and master per
  parameter, and FSDP's fp32 shard is that exact master, stored once across the ranks, with the bf16 weight gathered
  only for the pass; there is nothing to pack, and the results are O2's under FSDP, bit for bit.
* ``O3``, ``lean`` and ``lean-kahan`` keep half weights with no fp32 master. FSDP shards fp32 masters already (the
  memory those levels save is divided by the number of ranks), and ``O2`` gives the half compute: they are refused
  when the plugin is built, naming ``O2`` as the alternative.

The loss scaler is sharding-aware: each rank checks the gradients it holds, its shards, for inf/NaN (a rank whose
shard of a parameter is empty checks nothing for it), and one all-reduce (max) of the inf flags per optimizer step
makes every rank take the same decision, as torch's ``ShardedGradScaler`` does. Clipping by norm under the Trainer
goes through the root module's ``FullyShardedDataParallel.clip_grad_norm_``, which reduces the norm over all shards
(Fabric's strategy does the same itself).

A plain :class:`~lightning_mp.MixedPrecision` under ``strategy="fsdp"`` is refused by Lightning itself, before any
hook of the plugin runs: ``TypeError: The FSDP strategy can only work with the FSDPPrecision plugin``. Pass
``FSDPMixedPrecision`` with the same arguments instead. The other way round, ``FSDPMixedPrecision`` under another
strategy of the Trainer is refused at setup. Fabric does not tell a plugin its strategy, so its first forward finds
out: Fabric's ``FSDPStrategy`` wraps the model in ``FullyShardedDataParallel`` (or finds units inside it), whose
forward runs before the model's; where the model's own forward comes first (another strategy, where O2 would run as
O1), the plugin is refused there, pointing to :class:`~lightning_mp.MixedPrecision`. A forward pre-hook for every
module (torch's public ``register_module_forward_pre_hook``) sees the order during that first forward only.

Manual optimization under the Trainer (``automatic_optimization = False``): Lightning runs every ``training_step``
inside the root ``FullyShardedDataParallel``'s forward (its strategy reroutes the call through the wrapper), so a
``manual_backward`` there runs backward in the middle of FSDP's forward, which FSDP1 refuses (``Expects BACKWARD_PRE
or BACKWARD_POST state but got HandleTrainingState.FORWARD``), with Lightning's own ``FSDPPrecision`` too. With this
plugin the training step of such a module runs outside the root's forward instead, and each call of the module
itself (``self(x)``, its ``forward``) inside it goes through the root, as Fabric's model calls do: every forward is
FSDP's whole forward, every ``manual_backward`` FSDP's whole backward, and ``self.clip_gradients`` and
``opt.step()`` act on finished gradient shards. The model must compute through its ``forward`` there (a submodule
called directly would miss the root's gather). The plugin puts this in the place of the strategy's public
``training_step`` (an attribute of that strategy object, which the Trainer calls) when it connects to such a module,
and removes it at teardown; the automatic training step, validation, test and predict steps keep Lightning's. A
strategy subclass's own ``training_step`` is bypassed for manual steps: Lightning's runs the step inside the root.

Private names: :mod:`lightning_mp._private_names` lists them, with the reason for each.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.front_ends import attached_trainer
from lightning_mp.plugin import MixedPrecision
from lightning_mp.plugin.checkpoint import TORCH_SCALER_KEYS
from lightning_mp.policies import PrecisionPolicy
from lightning_mp.policies.fsdp_o2 import FSDPLeanExactPolicy, FSDPO2Policy
from lightning_mp.policies.sharded import HALF_GATHERING_LEVELS

FSDP_OPT_LEVELS = ("O0", "O1", "O2", "lean-exact")
"""The opt levels FSDP runs; the others keep half weights without fp32 masters, which FSDP shards itself."""
FSDP_POLICIES: dict[str, type[PrecisionPolicy]] = {"O2": FSDPO2Policy, "lean-exact": FSDPLeanExactPolicy}
"""The policy of each of :data:`~lightning_mp.policies.sharded.HALF_GATHERING_LEVELS` under FSDP1."""


def _instance_of(types: tuple[type[nn.Module], ...]) -> Callable[[nn.Module], bool]:
    """Whether a module is an instance of one of ``types`` (none: no module is)."""
    return lambda module: bool(types) and isinstance(module, types)


class _ManualTrainingStepBesideTheRoot:
    """The Trainer strategy's ``training_step`` for a module with manual optimization (module docstring).

    The module's ``training_step`` runs outside the root ``FullyShardedDataParallel``'s forward, in the precision
    plugin's ``train_step_context`` as Lightning's step runs it, and each call of the module's ``forward`` inside it
    goes through the root.

    Args:
        strategy: the Trainer's strategy, whose ``model`` is the root and ``lightning_module`` the module.

    """

    def __init__(self, strategy: FSDPStrategy) -> None:
        self.strategy = strategy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``training_step(*args, **kwargs)`` beside the root."""
        strategy = self.strategy
        root, module = strategy.model, strategy.lightning_module
        assert root is not None and module is not None
        with strategy.precision_plugin.train_step_context():
            if root is module:
                return module.training_step(*args, **kwargs)
            had_forward_of_its_own = "forward" in vars(module)
            module_forward = module.forward

            def forward_through_the_root(*forward_args: Any, **forward_kwargs: Any) -> Any:
                # The root calls the module back: that call must reach the module's own forward. (The instance
                # attribute shadows the method, which mypy does not allow to be assigned.)
                module.forward = module_forward  # type: ignore[method-assign]
                try:
                    return root(*forward_args, **forward_kwargs)
                finally:
                    module.forward = forward_through_the_root  # type: ignore[method-assign]  # shadows the method

            # For the step, the module's forward is an instance attribute that goes through the root.
            module.forward = forward_through_the_root  # type: ignore[method-assign]
            try:
                return module.training_step(*args, **kwargs)
            finally:
                if had_forward_of_its_own:
                    # The instance attribute it had before the step.
                    module.forward = module_forward  # type: ignore[method-assign]
                else:
                    del module.forward


# Lightning's FSDPPrecision types ``scaler`` as torch's ShardedGradScaler and ``optimizer_step`` with a required model;
# MixedPrecision's (a read-only LossScaler view, the model optional) come first and serve both.
class FSDPMixedPrecision(MixedPrecision, FSDPPrecision, FabricFSDPPrecision):  # type: ignore[misc]
    """:class:`~lightning_mp.MixedPrecision` for Lightning's ``FSDPStrategy``, under the Trainer and under Fabric.

    Takes exactly the arguments of :class:`~lightning_mp.MixedPrecision`, with the same meaning and checks.

    Raises:
        ValueError: for an opt level FSDP cannot run (``O3``, ``lean``, ``lean-kahan``), naming the
            alternative; for ``fp8``, which runs under FSDP2 (``ModelParallelStrategy``) only. Otherwise as
            :class:`~lightning_mp.MixedPrecision`.

    Example::

        trainer = Trainer(accelerator="gpu", devices=2, strategy="fsdp", plugins=[FSDPMixedPrecision("16-mixed")])

    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.opt_level not in FSDP_OPT_LEVELS:
            raise ValueError(
                f"FSDPMixedPrecision(opt_level={self.opt_level!r}) is not allowed: {self.opt_level} keeps the model's"
                " weights in half with no fp32 master, while FSDP keeps fp32 shards as the masters and gathers from"
                " them. Use opt_level='O2', where FSDP gathers half copies of its fp32 shards (the same half compute),"
                f" or 'O1'. Allowed: {list(FSDP_OPT_LEVELS)}."
            )
        if self.fp8_settings is not None:
            raise ValueError(
                f"FSDPMixedPrecision(fp8={self.fp8_settings.recipe!r}) is not allowed: torchao's float8 training"
                " shards with FSDP2 (fully_shard), not with FSDPStrategy's FSDP1. Use MixedPrecision('bf16-mixed',"
                f" fp8={self.fp8_settings.recipe!r}) with ModelParallelStrategy and call plugin.fp8_convert(self) in"
                " configure_model before fully_shard, or drop fp8 to train under FSDPStrategy."
            )
        eval_precision = self.settings.eval_precision
        if eval_precision in ("16-true", "bf16-true") or (
            self.opt_level in HALF_GATHERING_LEVELS and eval_precision not in (None, self.requested_precision)
        ):
            raise ValueError(
                f"FSDPMixedPrecision(opt_level={self.opt_level!r}, eval_precision={eval_precision!r}) is not allowed:"
                " FSDP computes with the weights it gathers in its own param_dtype, so evaluation cannot swap in other"
                " weights. Under FSDPStrategy evaluate in the training precision (eval_precision=None), or at O1 in"
                " another autocast ('16-mixed', 'bf16-mixed') or in '32-true'."
            )
        self._model: nn.Module | None = None
        """The module the strategy wraps (under the Trainer, the LightningModule, whose Trainer holds the root)."""
        self._units_checked = False
        """Whether the ``keep_fp32`` modules were checked to be fp32 FSDP units (O2), once per run."""
        self._strategy_stepping_manually: FSDPStrategy | None = None
        """The Trainer's strategy whose ``training_step`` runs manual training steps beside the root."""

    @property
    @override
    def mixed_precision_config(self) -> TorchMixedPrecision:
        """FSDP's mixed-precision policy for this plugin's precision and opt level (module docstring).

        Raises:
            RuntimeError: for ``precision="auto"`` before setup, when the precision is not known yet.

        """
        if self.precision == "auto":
            raise RuntimeError(
                "FSDPMixedPrecision(precision='auto') resolves its precision when the strategy sets the model up;"
                " mixed_precision_config is known from then on."
            )
        half_dtype = self.half_dtype
        if self.opt_level in HALF_GATHERING_LEVELS and half_dtype is not None:
            # The inputs stay as given (the Trainer's batch holds the targets too): autocast casts each op's inputs.
            return TorchMixedPrecision(
                param_dtype=half_dtype,
                reduce_dtype=half_dtype,
                buffer_dtype=torch.float32,
                cast_root_forward_inputs=False,
            )
        return TorchMixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

    def auto_wrap_policy(self, wrap: Iterable[type[nn.Module]] | Callable[[nn.Module], bool] = ()) -> CustomPolicy:
        """The ``auto_wrap_policy`` for ``FSDPStrategy`` that makes each ``keep_fp32`` module an fp32 FSDP unit (O2).

        Under O2 each outermost ``keep_fp32`` module becomes an FSDP unit of its own whose weights are gathered,
        reduced and stored in fp32 (its inputs cast to fp32); under O1 every unit is fp32 already. The other units
        are the modules ``wrap`` names: module types, or a function of the module. The modules are those the plugin
        matched when the strategy set the model up, so pass the policy to the strategy of this plugin's run::

            plugin = FSDPMixedPrecision("bf16-mixed", opt_level="O2", keep_fp32=[nn.LayerNorm])
            strategy = FSDPStrategy(auto_wrap_policy=plugin.auto_wrap_policy({TransformerBlock}))

        Args:
            wrap: the module types that become FSDP units, or a function that says which modules do.

        Returns:
            torch's ``CustomPolicy``: per module, False, True, or the keyword arguments of an fp32 unit.

        """
        is_unit = wrap if callable(wrap) else _instance_of(tuple(wrap))
        fp32_unit = {
            "mixed_precision": TorchMixedPrecision(
                param_dtype=torch.float32,
                reduce_dtype=torch.float32,
                buffer_dtype=torch.float32,
                cast_forward_inputs=True,
            )
        }

        def unit_of(module: nn.Module) -> bool | dict[str, Any]:
            policy = self.policy
            if isinstance(policy, FSDPO2Policy) and any(module is root for root in policy.fp32_roots):
                return fp32_unit
            return is_unit(module)

        return CustomPolicy(unit_of)

    def _check_fp32_units(self) -> None:
        """Under O2, refuse a ``keep_fp32`` module that FSDP did not make a unit of its own (:meth:`auto_wrap_policy`).

        Raises:
            ValueError: naming the module and the ``auto_wrap_policy`` to pass.

        """
        self._units_checked = True
        policy = self.policy
        if not isinstance(policy, FSDPO2Policy) or not policy.fp32_roots or self._model is None:
            return
        # A later stage (validate after fit) matches the unit itself: the fit's wrapping put it in the module's place.
        units = FullyShardedDataParallel.fsdp_modules(self._model)
        wrapped = {id(unit) for unit in units} | {id(unit.module) for unit in units}
        unwrapped = [root for root in policy.fp32_roots if id(root) not in wrapped]
        if unwrapped:
            names = {id(module): name for name, module in self._model.named_modules()}
            listed = [names.get(id(module), type(module).__name__) for module in unwrapped]
            raise ValueError(
                f"FSDPMixedPrecision(opt_level='O2', keep_fp32={self.keep_fp32!r}): the modules {listed} are not FSDP"
                " units of their own, so FSDP gathers their weights in the half dtype with the rest of their unit."
                " Pass FSDPStrategy(auto_wrap_policy=plugin.auto_wrap_policy(...)), which makes each keep_fp32"
                " module an fp32 unit, or use opt_level='O1'."
            )

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """As :meth:`MixedPrecision.connect`, once the Trainer's strategy has wrapped the model.

        Checks the ``keep_fp32`` units, and under manual optimization runs the training step outside the root's
        forward (module docstring).
        """
        self._check_fp32_units()
        trainer = attached_trainer(self._model)
        if trainer is not None and not trainer.lightning_module.automatic_optimization:
            strategy = trainer.strategy
            if not isinstance(vars(strategy).get("training_step"), _ManualTrainingStepBesideTheRoot):
                strategy.training_step = _ManualTrainingStepBesideTheRoot(strategy)
            self._strategy_stepping_manually = strategy
        return super().connect(model, optimizers, lr_schedulers)

    @contextlib.contextmanager
    def _refusing_a_model_outside_fsdp(self) -> Generator[None, None, None]:
        """Around Fabric's first forward: refuse a model that no ``FullyShardedDataParallel`` wraps.

        Fabric does not tell a plugin its strategy, so its first forward shows it: Fabric's ``FSDPStrategy`` wraps
        the model at its root (or finds units inside it), and the root wrapper's forward runs before the model's.

        Raises:
            ValueError: when the model's forward runs first, pointing to :class:`~lightning_mp.MixedPrecision`.

        """
        model = self._model
        if model is None or attached_trainer(model) is not None or FullyShardedDataParallel.fsdp_modules(model):
            yield
            return
        wrapped = False

        def check(module: nn.Module, args: Any) -> None:
            nonlocal wrapped
            if isinstance(module, FullyShardedDataParallel) and module.module is model:
                wrapped = True
            elif module is model:
                handle.remove()
                if not wrapped:
                    raise ValueError(
                        "FSDPMixedPrecision is the plugin's form for FSDPStrategy, but Fabric's strategy did not wrap"
                        f" the model ({type(model).__name__}) in FullyShardedDataParallel: there O2 would make no half"
                        " weights. Pass MixedPrecision with the same arguments instead."
                    )

        handle = register_module_forward_pre_hook(check)
        try:
            with warnings.catch_warnings():
                # A compiled model's wrapper warns that global hooks fire once more for it; this one ignores it.
                warnings.filterwarnings(
                    "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
                )
                yield
        finally:
            handle.remove()

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """As :meth:`MixedPrecision.forward_context`; Fabric's first forward checks FSDP's wrapping and the units.

        Raises:
            ValueError: under Fabric, when no ``FullyShardedDataParallel`` wraps the model (another strategy).

        """
        first = not self._units_checked and not torch.compiler.is_compiling()
        if first:
            self._check_fp32_units()
        with self._refusing_a_model_outside_fsdp() if first else contextlib.nullcontext(), super().forward_context():
            yield

    @override
    def _policy_class(self, opt_level: str, sharded: bool) -> type[PrecisionPolicy]:
        return FSDP_POLICIES.get(opt_level) or super()._policy_class(opt_level, sharded)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """As :meth:`MixedPrecision.convert_module`; remember the module the strategy is about to wrap.

        Raises:
            ValueError: under a Trainer whose strategy is not an ``FSDPStrategy`` (:class:`MixedPrecision` fits there).

        """
        trainer = attached_trainer(module)
        if trainer is not None and not isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                f"FSDPMixedPrecision is the plugin's form for FSDPStrategy, but the Trainer's strategy is"
                f" {type(trainer.strategy).__name__}: there O2 would make no half weights. Pass MixedPrecision with"
                " the same arguments instead."
            )
        if trainer is not None and trainer.strategy.mixed_precision is not None:
            rank_zero_warn(
                f"lightning_mp: FSDPStrategy(mixed_precision={trainer.strategy.mixed_precision}) replaces the policy"
                f" that {self!r} maps its opt level onto (plugin.mixed_precision_config). Leave the strategy's"
                " mixed_precision None to run the opt level as documented."
            )
        self._model = module
        self._units_checked = False
        return super().convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        """Create tensors in fp32: FSDP's shards of them are the master weights."""
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        """Create modules in fp32: FSDP's shards of their weights are the master weights."""
        return contextlib.nullcontext()

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm over every rank's shards, with the root module's ``clip_grad_norm_`` (Trainer).

        Raises:
            RuntimeError: when the Trainer's model is not wrapped in ``FullyShardedDataParallel`` at its root.

        """
        trainer = attached_trainer(self._model)
        root = trainer.strategy.model if trainer is not None else None
        if not isinstance(root, FullyShardedDataParallel):
            raise RuntimeError(
                "FSDPMixedPrecision clips by norm over all shards through the root FullyShardedDataParallel module,"
                f" but the Trainer's model is {type(root).__name__}. Use gradient_clip_algorithm='value', or let"
                " the FSDPStrategy wrap the model."
            )
        root.clip_grad_norm_(clip_val)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also put torch's five GradScaler keys under ``FSDPPrecision``, the entry Lightning's own FSDP plugin reads.

        Lightning's ``FSDPPrecision("16-mixed")`` then resumes from this checkpoint at the scale it reached, as
        Lightning's ``MixedPrecision`` does from the plain plugin's (:meth:`MixedPrecision.state_dict`).
        """
        state = checkpoint.get(type(self).__qualname__)
        if state:
            checkpoint["FSDPPrecision"] = {key: state[key] for key in TORCH_SCALER_KEYS if key in state}

    @override
    def teardown(self) -> None:
        """As :meth:`MixedPrecision.teardown`, forget the module, and give the strategy its own ``training_step``."""
        strategy, self._strategy_stepping_manually = self._strategy_stepping_manually, None
        if strategy is not None and isinstance(vars(strategy).get("training_step"), _ManualTrainingStepBesideTheRoot):
            del strategy.training_step
        self._model = None
        super().teardown()


__all__ = ["FSDP_OPT_LEVELS", "FSDPMixedPrecision"]
