"""FP8 for linear layers that store their weight transposed: transformers' ``Conv1D`` (GPT-2 and its family).

A ``Conv1D`` computes ``x @ weight + bias`` with a weight of shape ``(in_features, out_features)``: it is
``nn.Linear`` with the weight stored transposed, and torchao converts ``nn.Linear`` only. Replacing it by an
``nn.Linear`` holding ``weight.t()`` would change what the user holds: a new weight of another shape, so an optimizer
built before the conversion (Fabric) steps a tensor the model no longer uses, and ``state_dict`` and
``save_pretrained`` write a shape transformers' ``Conv1D`` cannot load.

:class:`Float8TransposedLinear` changes only the matmul. It takes the ``Conv1D``'s own ``weight`` and ``bias``
Parameter objects, under the same names, so the model's ``state_dict`` keeps its keys and shapes and every optimizer
keeps its tensors. Its forward hands the matmul to a torchao ``Float8Linear`` that holds no tensor of its own, with
``weight.t()`` in place of that layer's weight (``torch.func.functional_call``): ``Float8Linear`` multiplies by the
transpose of its weight, which here is the stored ``(in, out)`` weight itself. The casts, scales and gradients are
exactly those of a ``Float8Linear`` holding the transposed weight, under every recipe (``tests/fp8`` compares them bit
for bit); only the weight's memory layout differs, which torchao's matmul arranges itself. That a ``Float8Linear``
reads its weight as ``self.weight.t()`` is torchao's implementation (0.18), not its documented API: the bit-for-bit
test is what an upgrade that changes it fails.

:meth:`Float8TransposedLinear.restored` gives the original ``Conv1D`` object back, holding the layer's current
Parameters: the FP8 mode calls it at teardown and when the layer falls back to bf16.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

__all__ = ["Float8TransposedLinear", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (by its name and a 2-D ``(in, out)`` weight Parameter)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, nn.Parameter) and weight.dim() == 2


class Float8TransposedLinear(nn.Module):
    """A transposed-weight linear layer (``Conv1D``) whose matmuls run in FP8 (module docstring).

    Args:
        original: the ``Conv1D``; its ``weight`` and ``bias`` become this module's, the same objects.
        config: the torchao ``Float8LinearConfig`` of the recipe.

    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, original: nn.Module, config: Any) -> None:
        super().__init__()
        weight, bias = original.get_parameter("weight"), original.bias
        self.weight = weight
        self.register_parameter("bias", bias if isinstance(bias, nn.Parameter) else None)
        self.in_features: int = weight.shape[0]
        self.out_features: int = weight.shape[1]
        self.nx, self.nf = self.in_features, self.out_features  # the names transformers' Conv1D gives them
        float8 = importlib.import_module("torchao.float8")
        # FSDP2's float8 all-gather wraps a Float8Linear's own weight, which this one does not have.
        config = replace(config, enable_fsdp_float8_all_gather=False)
        with torch.device("meta"):
            matmul = float8.convert_to_float8_training(
                nn.Linear(self.in_features, self.out_features, bias=False), config=config
            )
        # Held in tuples, outside the module tree, so that state_dict, parameters() and .to() see this module's own
        # weight and bias only: the matmul's meta weight is replaced at every call, and the original shares them.
        self._matmul: tuple[nn.Module] = (matmul,)
        self._original: tuple[nn.Module] = (original,)
        self.train(original.training)

    @property
    def config(self) -> Any:
        """The torchao ``Float8LinearConfig`` the matmuls cast by, as a ``Float8Linear``'s ``config``."""
        return self._matmul[0].config

    def forward(self, input: Tensor) -> Tensor:
        """``input @ weight + bias``, the matmul in FP8 as torchao's ``Float8Linear`` computes it."""
        output: Tensor = torch.func.functional_call(self._matmul[0], {"weight": self.weight.t()}, (input,))
        return output if self.bias is None else output + self.bias.to(output.dtype)

    def restored(self) -> nn.Module:
        """The original ``Conv1D``, holding this layer's current weight and bias Parameters and its training mode."""
        original = self._original[0]
        original.register_parameter("weight", self.weight)
        original.register_parameter("bias", self.bias)
        original.train(self.training)
        return original

    @override
    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
