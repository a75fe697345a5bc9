"""Which parameters O2 gives a half model parameter.

O2 chooses the fp32 parameters of every module except:

- normalisation layers (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm and any class whose name ends in
  ``Norm``), which compute in fp32 on half inputs, and the subtrees that ``keep_fp32`` matches;
- recurrent layers: their forward reads a cached list of their weights, not the parameters the module holds;
- reparametrized weights (``torch.nn.utils.parametrize``: ``parametrizations.spectral_norm``, ``weight_norm``,
  ``orthogonal``; and the older ``nn.utils.spectral_norm``/``weight_norm`` hooks): the parametrization runs on the
  original parameter and may keep fp32 state that it updates in place (spectral norm's power iteration);
- sparse embeddings (``Embedding``/``EmbeddingBag`` with ``sparse=True``): their sparse gradients would need a
  sparse cast, and their optimizers (``SparseAdam``, SGD) are cheap on the rows a batch touches anyway.

The modules left out compute with their fp32 parameters under autocast, as in O1. A tied weight is one tensor in one
dtype: a parameter that any left-out module holds stays fp32 in every module that holds it (with a warning), so a
tie never splits into a master parameter on one side and a model parameter on the other. Parameters of other dtypes
(fp64) and every buffer keep their dtype.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_mp.policies.casting import is_normalization


def computes_weights_in_fp32(module: nn.Module) -> set[nn.Module]:
    """The modules under ``module`` whose forward needs their fp32 parameters themselves, not half model parameters.

    Reparametrized weights (their parametrization subtree, or a module with an older ``spectral_norm`` or
    ``weight_norm`` hook) and sparse embeddings: the module docstring says why.
    """
    found: set[nn.Module] = set()
    for child in module.modules():
        parametrizations = getattr(child, "parametrizations", None) if parametrize.is_parametrized(child) else None
        if isinstance(parametrizations, nn.Module):
            found.update(parametrizations.modules())
        sparse_embedding = isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse
        if _has_legacy_norm_hook(child) or sparse_embedding:
            found.add(child)
    return found


def choose_parameters(module: nn.Module, kept: set[nn.Module]) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """The fp32 parameters of ``module`` that O2 casts to half, by ``id``, with their names (a tied one has several).

    Args:
        module: the model.
        kept: the modules that ``keep_fp32`` keeps, tied ones included.

    """
    in_fp32 = kept | computes_weights_in_fp32(module)
    chosen: dict[int, tuple[nn.Parameter, list[str]]] = {}
    held_in_fp32: dict[int, str] = {}  # id of each parameter a module computing in fp32 holds -> its name there
    for module_name, child in module.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        own = child.named_parameters(recurse=False, remove_duplicate=False)
        if child in in_fp32 or is_normalization(child) or isinstance(child, nn.RNNBase):
            for name, parameter in own:
                held_in_fp32.setdefault(id(parameter), prefix + name)
            continue
        for name, parameter in own:
            if parameter.dtype != torch.float32:
                continue
            chosen.setdefault(id(parameter), (parameter, []))[1].append(prefix + name)
    for tied in chosen.keys() & held_in_fp32.keys():
        _, keys = chosen.pop(tied)
        rank_zero_warn(
            f"lightning_mp O2: {', '.join(repr(key) for key in keys)} stays an fp32 weight without a half copy: it"
            f" is tied to {held_in_fp32[tied]!r}, whose module computes with its fp32 weight, and tied weights are"
            " one tensor, in one dtype. Its modules compute with it under autocast, as in O1."
        )
    return chosen


def _has_legacy_norm_hook(module: nn.Module) -> bool:
    """Whether ``module`` has an older ``nn.utils.weight_norm`` or ``nn.utils.spectral_norm`` hook.

    Told by what the two leave on the module, in public view (nn.Module has no public way to list its hooks): the
    weight ``name`` turns into a plain tensor attribute, neither parameter nor buffer, which the hook recomputes at
    each forward from the parameters ``{name}_g`` and ``{name}_v`` (weight norm), or from the parameter
    ``{name}_orig`` and the buffers ``{name}_u`` and ``{name}_v`` (spectral norm).
    """
    parameters = {name for name, _ in module.named_parameters(recurse=False)}
    buffers = {name for name, _ in module.named_buffers(recurse=False)}
    for name, value in vars(module).items():
        if not isinstance(value, Tensor) or isinstance(value, nn.Parameter):
            continue
        g, v, orig, u = (f"{name}_{suffix}" for suffix in ("g", "v", "orig", "u"))
        if {g, v} <= parameters or (orig in parameters and {u, v} <= buffers):
            return True
    return False
