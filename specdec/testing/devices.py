"""Checking the device rules of an accelerator on a CPU-only machine.

On CUDA every tensor that meets another in an operation must be on the same device (a 0-dim
CPU tensor excepted), model inputs must be on the model's device, and a random draw must use a
generator on the device of the tensor it draws from. On a CPU-only machine all tensors are on
the CPU, so code that forgets a device runs fine and fails on the first GPU.

:class:`DeviceAudit` makes those mistakes visible without a GPU. It stands a *virtual
accelerator* next to the CPU: the device ``cpu:0`` (:data:`VIRTUAL_ACCELERATOR`), which torch
treats as the CPU but which code can name. Inside the audit (a ``TorchFunctionMode``) every
tensor carries a tag, "host" or "accel":

- factories (``torch.tensor``, ``zeros``, ``arange``, ...) tag by their ``device`` argument:
  ``cpu:0`` is the accelerator, anything else the host; ``*_like`` follow their input unless
  given a device; ``.to(d)`` / ``.cpu()`` retag; ``t.device`` reads ``cpu:0`` for an accel tensor,
  so ``torch.zeros(..., device=logits.device)`` lands where ``logits`` is;
- a model registered with :meth:`DeviceAudit.track` lives on the accelerator: its parameters
  and buffers are accel (so ``model.device`` and ``LoadedModel.device`` read ``cpu:0``), it must
  be called with accel inputs, its internals are not audited (they are transformers'), its
  logits come out accel;
- any other operation whose tensor arguments mix host and accel (0-dim host tensors excepted,
  as CUDA allows) is a violation, and so is a draw (``generator=``) whose generator's device
  is not the device of the tensor drawn from, and ``.numpy()`` of an accel tensor.

A violation raises :class:`DeviceMismatch` at once (and is recorded in ``violations``). The
rules are those of CUDA, a little stricter (CUDA also lets a CPU index tensor index a CUDA
tensor); code that passes the audit keeps every tensor where it says.

Limits: what happens inside a tracked model is not audited (transformers' own code, which runs
on CUDA as is); nor are CUDA-only failures that are not about devices (dtype support of a kernel,
memory, numerics). Those need a GPU: ``tests/test_gpu.py`` through ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

#: The device standing for the accelerator: the CPU under a name code can tell apart.
VIRTUAL_ACCELERATOR = torch.device("cpu", 0)

HOST, ACCEL = "host", "accel"

_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
    torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.randperm,
}
_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
         torch.randn_like, torch.randint_like}


_DEVICE_GET = torch.Tensor.device.__get__  # a method-wrapper: compare with ==, not `is`


class DeviceMismatch(AssertionError):
    """An operation that would fail on an accelerator (see the module docstring)."""


def _tag_of_device(device: Any) -> str:
    if device is None:
        return HOST
    if isinstance(device, int):
        return ACCEL  # a bare index means an accelerator ordinal
    d = torch.device(device)
    return ACCEL if d == VIRTUAL_ACCELERATOR or d.type != "cpu" else HOST


class DeviceAudit(TorchFunctionMode):
    """Run code under the accelerator's device rules (see the module docstring).

    Usage::

        with DeviceAudit() as audit:
            audit.track(target.model)   # the target now lives on the accelerator
            audit.track(draft.model)
            engine.generate(request)
        assert audit.model_calls > 0
    """

    def __init__(self) -> None:
        super().__init__()
        self.tags = WeakIdKeyDictionary()
        self.violations: list[str] = []
        self.model_calls = 0
        self.checked_ops = 0
        self._depth = 0
        self._hooks: list = []

    # --- models -------------------------------------------------------------------------------

    def track(self, model: torch.nn.Module) -> None:
        """Put ``model`` on the virtual accelerator for the audit: its parameters and buffers are
        accel, its inputs must be accel, its outputs' tensors are accel."""
        for t in list(model.parameters()) + list(model.buffers()):
            self.tags[t] = ACCEL

        def pre(module, args, kwargs):
            if self._depth == 0:
                for t in pytree.tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor) and self._tag(t) != ACCEL:
                        self._violate(f"model {type(module).__name__} called with an input on the host "
                                      f"(shape {tuple(t.shape)}); the model is on the accelerator")
                self.model_calls += 1
            self._depth += 1

        def post(module, args, kwargs, output):
            self._depth -= 1
            if self._depth == 0:
                for name in ("logits", "last_hidden_state"):
                    t = getattr(output, name, None)
                    if isinstance(t, torch.Tensor):
                        self.tags[t] = ACCEL
            return output

        self._hooks.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(post, with_kwargs=True))

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    # --- the rules ----------------------------------------------------------------------------

    def _tag(self, t: torch.Tensor) -> str:
        return self.tags.get(t, HOST)

    def _violate(self, message: str) -> None:
        self.violations.append(message)
        raise DeviceMismatch(message)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._depth > 0:  # inside a tracked model: transformers' business
            return func(*args, **kwargs)
        if func == _DEVICE_GET:
            t = args[0]
            return VIRTUAL_ACCELERATOR if self._tag(t) == ACCEL else func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        self.checked_ops += 1
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        generator = kwargs.get("generator")

        if func in _FACTORIES:
            out_tag = _tag_of_device(kwargs.get("device"))
            if generator is not None and _tag_of_device(generator.device) != out_tag:
                self._violate(f"torch.{name}: generator on {generator.device} draws on the {out_tag} device")
        elif func in _LIKE:
            out_tag = _tag_of_device(kwargs["device"]) if kwargs.get("device") is not None else self._tag(args[0])
        elif func is torch.Tensor.cpu:
            out_tag = HOST
        elif func is torch.Tensor.cuda:
            out_tag = ACCEL
        elif func is torch.Tensor.to:
            out_tag = self._tag(args[0])
            for a in list(args[1:]) + [kwargs.get("device")]:
                if isinstance(a, torch.Tensor):
                    out_tag = self._tag(a)
                elif isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
                    out_tag = _tag_of_device(a)
        else:
            if func is torch.Tensor.numpy and tensors and self._tag(tensors[0]) == ACCEL:
                self._violate("Tensor.numpy() of a tensor on the accelerator")
            seen = {self._tag(t) for t in tensors if not (t.dim() == 0 and self._tag(t) == HOST)}
            if len(seen) > 1:
                shapes = ", ".join(f"{self._tag(t)} {tuple(t.shape)}" for t in tensors)
                self._violate(f"{name}: tensors on different devices ({shapes})")
            out_tag = ACCEL if ACCEL in {self._tag(t) for t in tensors} else HOST
            if generator is not None:
                if _tag_of_device(generator.device) != out_tag:
                    self._violate(f"{name}: generator on {generator.device} used with a tensor on the {out_tag} device")
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tags[t] = out_tag
        return out
