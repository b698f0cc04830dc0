"""Fused optimizers: one update of K stacked members, each with its own hyperparameters.

HFTA (Wang et al., "Horizontally Fused Training Array", MLSys 2021,
https://arxiv.org/abs/2102.02344) fuses the optimizers of K models that differ only in their
hyperparameters: the per-model scalars (learning rate, weight decay, betas, eps, momentum) become
``(K,)`` vectors viewed as ``(K, 1, ..., 1)`` so they broadcast over each member's slice of a
stacked ``(K, ...)`` parameter. Each member's update follows the arithmetic of ``torch.optim``
(the foreach implementation) on that member alone, op for op:

The per-optimizer arithmetic lives in the table of optimizers
(:mod:`~sweepmaster.runtime.training.optimizers`): :class:`FusedOptimizer` keeps the members,
their state and their hyperparameters on the device, and each step hands the whole shard's
parameters, gradients and state to the entry's multi-tensor step (a constant number of
``torch._foreach_*`` operators, whatever the number of parameter tensors).
:class:`FusedSGD`, :class:`FusedAdamW` and :class:`FusedLion` are the entries' fused optimizers
(``torch.optim.SGD``, ``torch.optim.AdamW``, ``lion_pytorch.Lion``).

Per-member hyperparameters are made once on the device (float64 ``(K,)``, viewed ``(K, 1, ...)``
in the compute type, float32 like ``torch.optim`` uses for float32 and as ``opmath`` for 16-bit
parameters); each step copies its learning rates and step counts to the device at once
(asynchronously from pinned memory on a GPU) and computes the bias corrections there.
Results equal the plain optimizers up to floating-point rounding (tested: SGD allclose 1e-6
after several steps, AdamW and Lion within an lr-scaled tolerance).

Shape legend: K members; a stacked parameter ``p`` is ``(K, ...)``; ``x_K`` is a per-member
vector, ``x_K1`` the same viewed as ``(K, 1, ..., 1)`` to broadcast against ``p``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from sweepmaster.runtime.training.optimizers import FusedStep, OptimizerEntry, optimizer_entry
from sweepmaster.workload.spec import OptimizerSpec

__all__ = [
    "FusedAdamW",
    "FusedLion",
    "FusedOptimizer",
    "FusedSGD",
    "build_fused_optimizer",
    "clip_coefficients",
    "member_grad_norms",
]


class FusedOptimizer:
    """Optimizer of K stacked members; each member's update equals ``torch.optim`` on it alone.

    The optimizer does not hold the parameters: :meth:`step` receives them, because removing a
    member (:meth:`remove_member`) replaces every stacked parameter with a smaller one. Not
    thread-safe; one fused array owns one optimizer.

    Args:
        specs: One optimizer spec per member, all with the same ``name`` (the class's
            ``name`` where it sets one, else ``specs[0].name``).
        device: Where the stacked parameters (and so the optimizer state) live.

    Raises:
        ValueError: The specs are empty, mix optimizer names, or one is invalid for
            ``torch.optim`` (e.g. Nesterov without momentum, a negative learning rate).
    """

    name: str = ""

    def __init__(self, specs: Sequence[OptimizerSpec], device: torch.device) -> None:
        if not specs:
            raise ValueError("a fused optimizer needs at least one member")
        if not self.name:
            self.name = specs[0].name
        names = sorted({spec.name for spec in specs})
        if names != [self.name]:
            raise ValueError(f"{type(self).__name__} needs {self.name!r} members, got {names}")
        self.entry: OptimizerEntry = optimizer_entry(self.name)
        for spec in specs:
            _check_member(self.entry, spec)
        self._device = device
        self.specs = list(specs)
        self.num_steps = 0
        #: Optimizer steps each member has taken (more than ``num_steps`` for a resumed one).
        self.member_steps = [0] * len(self.specs)
        self._state: list[dict[str, Tensor]] = []
        #: (name, device) -> a per-member hyperparameter made once on a GPU (:meth:`_constant`)
        self._constants: dict[tuple[str, str], Tensor] = {}

    @property
    def num_members(self) -> int:
        """K, the members updated by one step."""
        return len(self.specs)

    @property
    def state(self) -> list[dict[str, Tensor]]:
        """Each stacked parameter's state tensors ``(K, ...)`` by name, in :meth:`step`'s order.

        Empty before the first step (or a loaded member state). The dicts are the optimizer's
        own: a caller may replace a tensor in them by a copy of the same shape and values
        elsewhere (a spilled array moves the state between the host and a device), and
        :meth:`step` updates whatever tensors they hold; a step that makes the state makes it
        on its parameters' device.
        """
        return self._state

    def step(self, params: Sequence[Tensor], lrs: Sequence[float]) -> None:
        """Update every member in place from its gradient (``p.grad``).

        One multi-tensor step of the entry over all of ``params`` at once (a constant number
        of operators, whatever their number). Beyond the parameters, gradients and state, it
        holds the scratch its entry declares to planning
        (:attr:`~sweepmaster.runtime.training.optimizers.OptimizerEntry.step_scratch`): none
        for SGD and AdamW, which work in place and use the gradients as scratch (after a step
        ``p.grad`` holds no gradient; the trainer drops it), one temporary per parameter for
        Lion, so a spilled array's just-in-time update stays within its shard's planned peak.

        Args:
            params: The stacked trainable parameters ``(K, ...)``, always in the same order;
                parameters whose ``grad`` is ``None`` are skipped, like ``torch.optim`` does.
            lrs: Each member's learning rate for this step (peak lr times its schedule factor).
        """
        assert len(lrs) == self.num_members
        self.num_steps += 1
        self.member_steps = [t + 1 for t in self.member_steps]
        keys = self._state_keys()
        if any(key not in state for state in self._state for key in keys) or not self._state:
            self.make_state(params)  # zeros: the first step gives what it gives from none
        stepped = [i for i, p in enumerate(params) if p.grad is not None]
        if not stepped:
            return
        lr_K, steps_K = self._per_step([list(lrs), [float(t) for t in self.member_steps]])
        dims = [params[i].dim() for i in stepped]
        with torch.no_grad():
            self.entry.fused_step(FusedStep(
                params=[params[i] for i in stepped],
                grads=[params[i].grad for i in stepped],  # type: ignore[misc]
                state={key: [self._state[i][key] for i in stepped] for key in keys},
                specs=self.specs, lr_K=lr_K, steps_K=steps_K,
                member_K=self._constant,
                per_param=lambda x_K, dtype=torch.float32: _per_param(x_K, dims, dtype),
            ))

    def remove_member(self, index: int) -> None:
        """Drop member ``index``: its state and hyperparameters; the others keep theirs exactly.

        Raises:
            IndexError: No such member.
        """
        if not 0 <= index < self.num_members:
            raise IndexError(f"member {index} out of range for {self.num_members} members")
        keep_K = torch.tensor(
            [k for k in range(self.num_members) if k != index],
            dtype=torch.long,
            device=self._device,
        )
        self.specs.pop(index)
        self.member_steps.pop(index)
        self._constants.clear()
        self._state = [
            {name: tensor.index_select(0, keep_K) for name, tensor in state.items()}
            for state in self._state
        ]

    def add_member(self, spec: OptimizerSpec, params: Sequence[Tensor]) -> None:
        """A member joins last with a fresh ``torch.optim``'s state (zeros, step 0).

        Every state tensor is zero-padded to the new stacked parameters' shape: one more
        member, and larger trailing sizes where the array re-padded (a larger LoRA rank), whose
        padding holds zero state like every other padding. A zero momentum buffer or zero
        moments give exactly the first update ``torch.optim`` gives a member without state.

        Args:
            spec: The new member's optimizer, of this optimizer's ``name``.
            params: The stacked trainable parameters ``(K + 1, ...)`` with the new member
                last, in :meth:`step`'s order.

        Raises:
            ValueError: ``spec`` has another optimizer name or is invalid for ``torch.optim``.
        """
        if spec.name != self.name:
            raise ValueError(f"{type(self).__name__} needs {self.name!r} members, "
                             f"got {spec.name!r}")
        _check_member(self.entry, spec)
        grown: list[dict[str, Tensor]] = []  # new tensors: the state changes once all exist
        for p, state in zip(params, self._state or [{} for _ in params], strict=True):
            grown.append({})
            for key, tensor in state.items():
                padded = tensor.new_zeros(p.shape)
                padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
                grown[-1][key] = padded
        self._state = grown if self._state else []
        self.specs.append(spec)
        self.member_steps.append(0)
        self._constants.clear()

    def undo_point(self) -> Callable[[], None]:
        """A function that puts the members and their state back as they are now.

        For a join that fails after :meth:`add_member` (and :meth:`load_member_state`): both
        put new state tensors in place of the old ones, which the undo restores.
        """
        specs, steps, num_steps = list(self.specs), list(self.member_steps), self.num_steps
        state = [dict(entry) for entry in self._state]

        def undo() -> None:
            self.specs, self.member_steps, self.num_steps = specs, steps, num_steps
            self._state = state
            self._constants.clear()

        return undo

    def member_state(self, index: int, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Member ``index``'s state per parameter name, as ``torch.optim`` keeps it (copies).

        The format of
        :func:`~sweepmaster.runtime.training.training_state.optimizer_state_by_name`, so the
        member can resume unfused, or in another array (:meth:`load_member_state`).

        Args:
            index: Position of the member.
            names: ``names[i]`` is the name of the ``i``-th stacked trainable parameter.

        Returns:
            Name -> state (the entry's state keys, e.g. AdamW: ``step``, ``exp_avg``,
            ``exp_avg_sq``; SGD: ``momentum_buffer``; Lion: ``exp_avg``); empty before the
            member's first step.
        """
        step = self.member_steps[index]
        if step == 0 or not self._state:
            return {}
        return {
            name: self._member_entry(step, {key: t[index].detach().clone()
                                            for key, t in state.items()})
            for name, state in zip(names, self._state, strict=True) if state
        }

    def load_member_state(self, index: int, params: Sequence[Tensor],
                          state: Mapping[str, dict[str, Any]], names: Sequence[str]) -> None:
        """Put a member's per-name state (:meth:`member_state` or a ``torch.optim``'s) in place.

        Missing stacked state tensors are created as zeros, which is what every other member
        that has not stepped yet would start from. A state tensor smaller than the stacked one
        (an unpadded LoRA adapter's) fills its leading corner.

        Args:
            index: Position of the member.
            params: The stacked trainable parameters ``(K, ...)``, as :meth:`step` gets them.
            state: Name -> the member's state, from a checkpoint.
            names: ``names[i]`` is the name of ``params[i]``.
        """
        if not self._state:
            self._state = [{} for _ in params]
        for p, name, stacked in zip(params, names, self._state, strict=True):
            for key, value in state.get(name, {}).items():
                if key == "step":
                    self.member_steps[index] = int(value)
                elif isinstance(value, Tensor):
                    if key not in stacked:
                        stacked[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    # A LoRA member's adapter is padded to the array's largest rank: its
                    # state fills the leading corner, the padding's state stays zero.
                    stacked[key][index][tuple(slice(0, n) for n in value.shape)].copy_(value)

    def make_state(self, params: Sequence[Tensor]) -> None:
        """Make the state tensors a first step would make (zeros) where there are none yet.

        So that the state exists before the first step (a spilled array lays it out flat:
        :mod:`~sweepmaster.runtime.training.flat`); a step then updates it exactly as it
        updates the state it would have made.

        Args:
            params: The stacked trainable parameters ``(K, ...)``, in :meth:`step`'s order.
        """
        if not self._state:
            self._state = [{} for _ in params]
        for p, state in zip(params, self._state, strict=True):
            for key in self._state_keys():
                if key not in state:
                    state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _state_keys(self) -> list[str]:
        """The state tensors each parameter has once the optimizer stepped (any member's)."""
        keys: list[str] = []
        for spec in self.specs:
            keys += [key for key in self.entry.state_keys(spec) if key not in keys]
        return keys

    def _member_entry(self, step: int, tensors: dict[str, Tensor]) -> dict[str, Any]:
        """One parameter's plain optimizer state entry of a member.

        Its tensors, and the step count as a float32 scalar where the plain optimizer keeps
        one (AdamW).
        """
        if self.entry.step_counter:
            return {"step": torch.tensor(float(step), dtype=torch.float32), **tensors}
        return tensors

    def _constant(self, name: str, values: Sequence[float | bool],
                  dtype: torch.dtype = torch.float64) -> Tensor:
        """A per-member hyperparameter ``(K,)`` on the device, made once there (HFTA).

        On a GPU it is kept until the members change, made by an asynchronous copy from
        pinned memory: a step waits for nothing on the host. On the CPU (a virtual device
        counts what lives on it) it is made for the step.
        """
        if self._device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        key = (name, str(self._device))
        made = self._constants.get(key)
        if made is None:
            made = self._constants[key] = _on_device(torch.tensor(values, dtype=dtype),
                                                     self._device)
        return made

    def _per_step(self, rows: Sequence[Sequence[float]]) -> Tensor:
        """Per-member scalars of one step (each row one scalar of every member) ``(R, K)``.

        Float64 (Python's floats), on the device in one copy (asynchronous from pinned memory
        on a GPU).
        """
        return _on_device(torch.tensor(rows, dtype=torch.float64), self._device)


class FusedSGD(FusedOptimizer):
    """``torch.optim.SGD`` (momentum, weight decay, Nesterov) for K members at once (HFTA).

    Example:
        >>> specs = [OptimizerSpec(name="sgd", lr=0.1, momentum=m) for m in (0.0, 0.9)]
        >>> optimizer = FusedSGD(specs, torch.device("cpu"))
        >>> p = torch.ones(2, 3, requires_grad=True)
        >>> p.grad = torch.ones(2, 3)
        >>> optimizer.step([p], lrs=[0.1, 0.1])
    """

    name = "sgd"


class FusedAdamW(FusedOptimizer):
    """``torch.optim.AdamW`` for K members at once, per-member lr, betas, eps, weight decay.

    Example:
        >>> specs = [OptimizerSpec(lr=1e-3, betas=(0.9, b2)) for b2 in (0.99, 0.999)]
        >>> optimizer = FusedAdamW(specs, torch.device("cpu"))
        >>> p = torch.ones(2, 3, requires_grad=True)
        >>> p.grad = torch.ones(2, 3)
        >>> optimizer.step([p], lrs=[1e-3, 1e-3])
    """

    name = "adamw"


class FusedLion(FusedOptimizer):
    """``lion_pytorch.Lion`` for K members at once, per-member lr, betas, weight decay.

    Example:
        >>> specs = [OptimizerSpec(name="lion", lr=1e-4, betas=(0.9, b2)) for b2 in (0.95, 0.99)]
        >>> optimizer = FusedLion(specs, torch.device("cpu"))
        >>> p = torch.ones(2, 3, requires_grad=True)
        >>> p.grad = torch.ones(2, 3)
        >>> optimizer.step([p], lrs=[1e-4, 1e-4])
    """

    name = "lion"


def build_fused_optimizer(specs: Sequence[OptimizerSpec], device: torch.device) -> FusedOptimizer:
    """The fused optimizer for members that all use ``specs[0].name`` (an entry of the table).

    Raises:
        ValueError: Empty ``specs``, mixed or unknown optimizer names, or an invalid member.
    """
    if not specs:
        raise ValueError("a fused optimizer needs at least one member")
    optimizer_entry(specs[0].name)
    return FusedOptimizer(specs, device)


def member_grad_norms(grads: Sequence[Tensor]) -> list[Tensor]:
    """Each stacked gradient's per-member 2-norm: one ``(K,)`` tensor per ``(K, ...)`` gradient.

    The per-tensor norms ``clip_grad_norm_`` stacks, for K members at once; a member's global
    norm is the 2-norm of its entries over every tensor, in any grouping (a spilled array
    computes them shard by shard and combines them on the last backward task).
    """
    with torch.no_grad():
        return [torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1) for g in grads]


def clip_coefficients(total_norm_K: Tensor, max_norms: Sequence[float | None]) -> Tensor:
    """``clip_grad_norm_``'s scale of each member: ``min(1, max_norm / (total_norm + 1e-6))``.

    Args:
        total_norm_K: Each member's global gradient norm ``(K,)``.
        max_norms: Per member, the max norm or ``None`` (scale 1: not clipped).

    Returns:
        ``coef_K`` ``(K,)`` in ``total_norm_K``'s dtype and device.
    """
    device = total_norm_K.device
    max_norm_K = torch.tensor([math.inf if m is None else m for m in max_norms],
                              dtype=total_norm_K.dtype, device=device)
    clip_K = torch.tensor([m is not None for m in max_norms], device=device)
    # ``max_norm / t`` with a Python float is ``t.reciprocal() * max_norm``: the same rounding
    coef_K = torch.clamp((total_norm_K + 1e-6).reciprocal() * max_norm_K, max=1.0)
    return torch.where(clip_K, coef_K, torch.ones_like(coef_K))


def _on_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device``: itself on the CPU, else an asynchronous copy from pinned memory."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _per_param(x_K: Tensor, dims: Sequence[int], dtype: torch.dtype) -> list[Tensor]:
    """``x_K`` ``(K,)`` as one ``(K, 1, ..., 1)`` view per parameter of ``dims`` dimensions.

    One view per distinct number of dimensions (a handful), shared by the parameters: the
    operators do not grow with the number of parameters.
    """
    x_K = x_K.to(dtype)
    views = {dim: x_K.view((-1,) + (1,) * (dim - 1)) for dim in set(dims)}
    return [views[dim] for dim in dims]


def _check_member(entry: OptimizerEntry, spec: OptimizerSpec) -> None:
    """The plain optimizer's own validation of one member, and the entry's."""
    entry.check(spec)
    entry.build([nn.Parameter(torch.zeros(1))], spec)
