"""The monitors' skeletons: the end-of-batch hook they share, and a monitor that samples steps and draws heatmaps.

:class:`TelemetryCallback` hands Lightning's ``on_train_batch_end`` on as ``batch_ended``: every monitor measures a
batch once its optimizer step is taken or skipped.

:class:`SampledMonitor` is the skeleton of the monitors that measure only some steps (a *sample* every
``every_n_steps`` steps) and draw their samples as per-layer heatmaps, the precision sentinel and the FP8 monitor.
It owns what they do alike, so that each of them holds only its measurement and its rules:

- the three arguments they share, validated once (``every_n_steps``, ``log_heatmaps``, ``heatmap_every_n_samples``);
- ``setup``: matplotlib is asked for where heatmaps will be drawn, and the monitor joins the one device-to-host read
  a batch (:mod:`~lightning_mp.measuring.host_reads`), which ``teardown`` leaves; every batch submits to it, an
  unsampled one with nothing to read, a sampled one in :meth:`SampledMonitor.sample_ended`;
- the hooks a sampled step attaches (:meth:`SampledMonitor.watch`), removed when the sample ends, when the fit raises
  and at teardown (:meth:`SampledMonitor.stop_sampling`);
- the samples, and the heatmaps redrawn from them every ``heatmap_every_n_samples`` samples and at the end of
  training: one per quantity the monitor names (:attr:`SampledMonitor.heatmap_quantities`), one row per layer
  (:meth:`SampledMonitor.heatmap_rows`), one column per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mp.measuring.heatmaps import HeatmapStyle, render_heatmap, require_matplotlib
from lightning_mp.measuring.host_reads import Consumer, host_reads
from lightning_mp.measuring.logging_steps import tensorboard_writers, validate_bool, validate_positive_int


class TelemetryCallback(Callback):
    """The monitors' common base: Lightning's end-of-batch hook, handed on as :meth:`batch_ended`.

    The monitors measure a training batch once its optimizer step is taken or skipped; none of them needs the
    batch's outputs or inputs.
    """

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.batch_ended(trainer, pl_module, batch_idx)

    def batch_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        """A training batch ended, after its optimizer step (taken or skipped); ``batch_idx`` is Lightning's."""


class StepSample(Protocol):
    """A sample: the logging step it was measured at, and whatever the monitor measured."""

    @property
    def step(self) -> int:
        """The step the sample's scalars are logged at."""


SampleT = TypeVar("SampleT", bound=StepSample)
HeatmapQuantities = Mapping[str, tuple[str, HeatmapStyle]]
"""``TensorBoard tag -> (quantity, style)``: the heatmaps a monitor draws, one per quantity it measures per layer."""


class SampledMonitor(TelemetryCallback, Generic[SampleT]):
    """The skeleton of a monitor that measures every ``every_n_steps`` steps and draws heatmaps (module docstring).

    Args:
        every_n_steps: measure at the steps ``log_every_n_steps=every_n_steps`` logs at.
        log_heatmaps: write the heatmaps to TensorBoard loggers.
        heatmap_every_n_samples: redraw the heatmaps every this many samples (and at the end of training).

    Raises:
        ValueError: if an argument is outside its range; the message names the argument, the value and what is
            allowed.

    """

    def __init__(self, every_n_steps: int, log_heatmaps: bool, heatmap_every_n_samples: int) -> None:
        self.every_n_steps = validate_positive_int("every_n_steps", every_n_steps)
        self.log_heatmaps = validate_bool("log_heatmaps", log_heatmaps)
        self.heatmap_every_n_samples = validate_positive_int("heatmap_every_n_samples", heatmap_every_n_samples)
        self.samples: list[SampleT] = []
        """Every sample of this fit, in order."""
        self._samples_drawn = 0
        self._sampling = False
        self._handles: list[RemovableHandle] = []

    heatmap_quantities: ClassVar[HeatmapQuantities] = {}
    """The heatmaps this monitor draws (:data:`HeatmapQuantities`)."""

    def heatmap_rows(self, quantity: str) -> Mapping[str, Sequence[float]]:
        """``row label -> one value per sample`` of ``quantity`` (NaN where a sample has none); no rows, no heatmap."""
        raise NotImplementedError(f"{type(self).__name__} draws {quantity!r} but gives no heatmap_rows for it.")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.log_heatmaps and tensorboard_writers(trainer):
            require_matplotlib(type(self).__name__)
        host_reads(trainer).join(self)
        self.samples, self._samples_drawn = [], 0

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(self.samples) > self._samples_drawn:
            self.draw(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop_sampling()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.stop_sampling()
        host_reads(trainer).leave(self)

    @override
    def batch_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        if not self._sampling:
            self.submit(trainer)
            return
        self.remove_hooks()
        self.sample_ended(trainer, pl_module, batch_idx)

    def sample_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        """A batch this monitor sampled ended, its hooks removed: :meth:`submit` what it measured, once.

        It ends the sample (``self._sampling = False``) unless the sample goes on into the next batch.
        """
        raise NotImplementedError(f"{type(self).__name__} samples batches but gives no sample_ended.")

    def submit(self, trainer: pl.Trainer, values: Tensor | None = None, consume: Consumer | None = None) -> None:
        """Hand this batch's ``values`` to the one host read, ``consume`` to get them as floats (none: nothing to read).

        .. warning:: The last submission of a batch synchronises the host, once, if any monitor submitted values.
        """
        host_reads(trainer).submit(trainer, self, values, consume)

    def watch(self, module: nn.Module, hook: Callable[..., None]) -> None:
        """Register ``hook`` as a forward hook of ``module`` until the sample ends."""
        self._handles.append(module.register_forward_hook(hook))

    def remove_hooks(self) -> None:
        """Remove the hooks :meth:`watch` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stop_sampling(self) -> None:
        """End the sample: remove its hooks; a subclass also drops what it had half measured."""
        self.remove_hooks()
        self._sampling = False

    def keep_sample(self, sample: SampleT) -> None:
        """Add a finished sample to :attr:`samples`."""
        self.samples.append(sample)

    def draw_if_due(self, trainer: pl.Trainer) -> None:
        """Redraw the heatmaps when ``heatmap_every_n_samples`` samples came since they were drawn."""
        if len(self.samples) - self._samples_drawn >= self.heatmap_every_n_samples:
            self.draw(trainer)

    def draw(self, trainer: pl.Trainer) -> None:
        """Draw each of :attr:`heatmap_quantities` to every TensorBoard logger, as an image at the latest step."""
        self._samples_drawn = len(self.samples)
        writers = tensorboard_writers(trainer) if self.log_heatmaps else []
        if not writers:
            return
        steps = [sample.step for sample in self.samples]
        for tag, (quantity, style) in self.heatmap_quantities.items():
            rows = self.heatmap_rows(quantity)
            if not rows:
                continue
            image = render_heatmap(style, list(rows), steps, list(rows.values()))
            for writer in writers:
                writer.add_image(tag, image, global_step=steps[-1], dataformats="HWC")
                writer.flush()


__all__ = ["HeatmapQuantities", "SampledMonitor", "StepSample", "TelemetryCallback"]
