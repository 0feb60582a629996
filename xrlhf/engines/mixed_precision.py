"""Mixed precision the way DeepSpeed's bf16 optimizer and Megatron do it: bf16 weights for the
forward and the backward, fp32 master weights and fp32 gradient accumulation on the optimizer's
side.

Why not ``torch.autocast`` over fp32 weights (the path before issue 25): autocast casts every
weight to bf16 again in each micro-batch (and per logprob chunk in the backward), keeps the
residual stream in fp32 (so q/k reach the attention in fp32 and the flash kernel cannot take
them), and leaves AdamW with 200-odd small fp32 tensors. Here the model's trainable parameters
*are* bf16, views into one flat bf16 buffer; the optimizer sees one flat fp32 master tensor and
its flat fp32 gradient:

* each bf16 gradient is added into its slice of the fp32 gradient as soon as autograd has it
  (a post-accumulate-grad hook per parameter) and freed, so micro-batches accumulate in fp32 and
  no bf16 gradient outlives its backward;
* the data-parallel all-reduce and the clipping work on the flat fp32 gradient (one call each);
* AdamW (fused on a GPU) steps the fp32 masters, and one copy writes them back to the bf16
  buffer: an update below bf16's spacing stays in the masters and shows once they move far
  enough, as in fp32 training.

The forward and backward cost what pure bf16 costs; memory per trained parameter is 2 (bf16) +
4 (master) + 4 (gradient) + 8 (AdamW) bytes.
"""

from __future__ import annotations

from typing import Iterator

import torch


class MasterWeights:
    """fp32 masters and gradients of bf16 ``params``, each a slice of one flat buffer.

    Args:
        params: the trainable parameters (each once: tied weights share one), in the dtype their
            masters start from (fp32 for an exact start); converted in place to ``dtype`` views of
            one flat buffer, so the model computes in ``dtype``.
        dtype: the compute dtype (bf16).

    Attributes:
        flat: ``[N]`` the fp32 master weights as one ``nn.Parameter``: what the optimizer steps;
            its ``grad`` (``MasterWeights.grad``, ``[N]``) accumulates the micro-batches'
            gradients in fp32.
        compute: ``[N]`` the ``dtype`` buffer the model's parameters are views of.
    """

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype = torch.bfloat16):
        if not params:
            raise ValueError("MasterWeights: no trainable parameters")
        self.params = params
        self.numels = [p.numel() for p in params]
        with torch.no_grad():
            self.flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1).float() for p in params]))
            self._grad = torch.zeros_like(self.flat)
            self.flat.grad = self._grad
            self.compute = self.flat.detach().to(dtype)
        for p, grad, compute in zip(params, self._split(self._grad), self._split(self.compute)):
            p.data = compute.view_as(p)  # the same Parameter, now a bf16 view of the flat buffer
            p.grad = None
            p.register_post_accumulate_grad_hook(_accumulate_into(grad.view_as(p)))

    def _split(self, flat: torch.Tensor) -> Iterator[torch.Tensor]:
        offset = 0
        for n in self.numels:
            yield flat[offset:offset + n]
            offset += n

    @property
    def grad(self) -> torch.Tensor:
        """``[N]`` the fp32 gradient accumulated since the last ``zero_grad``."""
        return self._grad

    def all_reduce(self) -> None:
        """Sum the fp32 gradient over the data-parallel group (one collective), and make it the
        masters' ``grad`` for the optimizer (again, if an ``optimizer.zero_grad`` unset it)."""
        import torch.distributed as dist

        self.flat.grad = self._grad
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self._grad)

    def publish(self) -> None:
        """Write the masters into the model's bf16 parameters (after an optimizer step or a load)."""
        with torch.no_grad():
            self.compute.copy_(self.flat)

    def zero_grad(self) -> None:
        self._grad.zero_()
        self.flat.grad = self._grad

    def named_grads(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The fp32 gradient of each parameter by ``names`` (in ``params``' order), as views."""
        return {n: g.view_as(p) for n, g, p in zip(names, self._split(self._grad), self.params)}

    def named_masters(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The fp32 master of each parameter by ``names`` (in ``params``' order), as views."""
        return {n: m.view_as(p) for n, m, p in zip(names, self._split(self.flat.detach()), self.params)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The masters, on the CPU (the gradient is zero between steps and not kept)."""
        return {"flat": self.flat.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict``'s masters and write them into the bf16 parameters.

        Raises:
            ValueError: the saved masters are of another size (another model or LoRA setting).
        """
        saved = state["flat"]
        if saved.shape != self.flat.shape:
            raise ValueError(f"mixed precision: the checkpoint's master weights have {saved.numel():,} entries, this "
                             f"model trains {self.flat.numel():,} (was it saved with other lora or dtype options?)")
        with torch.no_grad():
            self.flat.copy_(saved)
        self.publish()


def _accumulate_into(grad: torch.Tensor):
    """The hook that adds a parameter's bf16 gradient into its fp32 slice ``grad`` and frees it."""

    def hook(param: torch.Tensor) -> None:
        grad.add_(param.grad)
        param.grad = None

    return hook
