"""O2's forward and backward contexts: which side of each parameter pair the model shows, from a forward to the step.

Forward (:class:`O2ForwardContext`, around every training, validation, test and predict step and Fabric's forward):
the outermost entry shows the half model parameters, after writing into them the masters edited since
(:mod:`lightning_mp.policies.o2.parameters`) and mirroring ``requires_grad``. A forward without gradients
(validation, test, predict) shows the masters again at its exit. A forward with gradients leaves the model
parameters shown for its backward, and the step shows the masters; its exit shows them itself where the forward
failed, or where a backward ran inside it (manual optimization's ``training_step``, stepping or not), since nothing
waits for a backward there. Autocast stays on around it, for what is not a chosen weight: fp32 inputs of matrix
products, losses and softmax-like reductions in fp32, normalisation layers in fp32 on half inputs. Since embeddings
are half, the residual stream and the activations saved for backward are half too.

Writes through ``.data`` move no version counter; Lightning's ``WeightAveraging`` swaps the average in and out that
way around validation. So the first forward without gradients after one with them, and the reverse, write every
master into its model parameter; except between a forward with gradients and the start of its backward, where that
graph saved the model parameters (a write would fail the backward) and no master can have changed: a forward without
gradients there (a metric or pseudo-label pass) computes with the model parameters as they are.

Backward (:class:`O2BackwardContext`) flows into the model parameters, whose ``.grad`` is half, where autograd and
DDP accumulate it (``no_sync`` gradient accumulation included). It shows them where the model does not, so that from
the training forward to the step the model shows them with their gradients (``on_before_backward``,
``on_after_backward``, ``clip_grad_norm_`` of ``self.parameters()`` after ``manual_backward``, Fabric code between
the forward and the step). Inside a step, where ``toggle_optimizer`` sets ``requires_grad`` on the masters the
optimizer holds, it keeps gradients from the model parameters whose masters do not require them; and it leaves in
each master the ``.grad`` by which a later ``zero_grad`` is seen (the parameters module says how).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_mp.policies.o2.parameters import ParameterPairs, empty_gradient

if TYPE_CHECKING:
    from lightning_mp.policies.o2.policy import O2Policy


class O2ForwardContext(AbstractContextManager):
    """Shows the half model parameters from the outermost forward's entry; at its exit, the masters again.

    The exit leaves the model parameters shown where a backward waits for them (a training forward).
    """

    def __init__(self, policy: O2Policy) -> None:
        self.policy = policy

    def __enter__(self) -> None:
        policy = self.policy
        pairs = policy.pairs
        if pairs is None:
            return
        policy.forward_depth += 1
        if policy.forward_depth == 1:
            if policy.lazy_params:
                policy.pair_materialized_lazy_params()
            if pairs.master_params and pairs.master_params[0].device != pairs.model_params[0].device:
                pairs.follow_devices()
            if pairs.model_params_shown:
                # Left there by a forward with gradients that no step followed yet (gradient accumulation, a loss
                # dropped): what was written into them since is copied before any master is written over it.
                pairs.copy_model_param_edits()
            # Where evaluation starts or ends every master is written: writes through .data move no version counter.
            evaluating = not torch.is_grad_enabled()
            boundary = evaluating != policy.evaluating and not policy.awaiting_backward
            everything = range(len(pairs.master_params)) if boundary else ()
            policy.evaluating = evaluating
            if not evaluating:
                policy.awaiting_backward = True
            pairs.master_params_to_model_params(everything, show=True, mirror=True)

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        policy = self.policy
        if policy.forward_depth == 0:
            return
        policy.forward_depth -= 1
        if policy.forward_depth or policy.pairs is None:
            return
        # A training step that ran its backward inside (manual optimization) leaves no graph for a later backward:
        # the masters come back whether or not it stepped, as after every step of automatic optimization.
        finished = policy.evaluating or policy.stepped_in_forward or not policy.awaiting_backward
        if finished or exc_type is not None:
            policy.stepped_in_forward = False
            policy.pairs.show_master_params()


class O2BackwardContext(AbstractContextManager):
    """Shows the half model parameters for the backward; those whose masters need no gradient get none."""

    def __init__(self, policy: O2Policy, pairs: ParameterPairs) -> None:
        self.policy = policy
        self.pairs = pairs
        self.frozen: list[nn.Parameter] = []
        """The model parameters this backward keeps from gradients, to require them again at its exit."""

    def __enter__(self) -> None:
        pairs = self.pairs
        self.policy.awaiting_backward = False
        # Nothing is written into the model parameters here: backward computes with what the forward saved.
        show = not pairs.model_params_shown
        frozen = self.frozen
        markers, marks, versions = pairs.markers, pairs.marks, pairs.mark_versions
        for i, (master, model_param, holders) in enumerate(
            zip(pairs.master_params, pairs.model_params, pairs.holders, strict=True)
        ):
            if model_param.requires_grad and not master.requires_grad:
                model_param.requires_grad_(False)
                frozen.append(model_param)
            if show:
                for module, name in holders:
                    module._parameters[name] = model_param
            # A zero_grad since the last backward (the master's .grad is not what that backward left, or was zeroed
            # in place) discards what waits on the model parameter, before this backward adds to it.
            mark, grad = marks[i], master.grad
            if mark is not None and (grad is not mark or mark._version != versions[i]):
                model_param.grad = None
                if grad is markers[i]:  # zeroed in place: a zero gradient, as torch leaves it
                    master.grad = grad = torch.zeros_like(master)
                marks[i] = None
            if model_param.requires_grad:
                if grad is None:
                    marker = markers[i]
                    if marker.device != master.device:  # the master was moved since (not by follow_devices)
                        marker = markers[i] = empty_gradient(master)
                    grad = master.grad = marker
                marks[i] = grad
                versions[i] = grad._version
        pairs.model_params_shown = True

    def __exit__(self, *exc_info: object) -> None:
        for model_param in self.frozen:
            model_param.requires_grad_(True)
        self.frozen.clear()
