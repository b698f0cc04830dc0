"""The table of optimizers: one entry per optimizer holds everything that varies by optimizer.

An entry (:class:`OptimizerEntry`) says which :class:`~sweepmaster.workload.spec.OptimizerSpec`
settings the optimizer reads (the ``train.*`` keys a sweep file may set for it), how it checks
them, which state tensors it keeps per parameter (what planning counts as state bytes and what a
checkpoint holds), the scratch a step needs above them, how plain training builds it
(``torch.optim`` or the library that defines it) and its fused step: the update of K stacked
members, each with its own hyperparameters (HFTA, Wang et al., "Horizontally Fused Training
Array", MLSys 2021, https://arxiv.org/abs/2102.02344), as a handful of multi-tensor
(``torch._foreach_*``) operations over all of a shard's parameters at once: the count of
operators a step runs does not grow with the number of parameter tensors, nothing in it loops
over parameters in Python and nothing waits for the device.

Adding an optimizer is one entry in :data:`OPTIMIZERS` (and its name in
:data:`~sweepmaster.workload.spec.OptimizerName`), plus its tests.

Fused arithmetic, per member ``k`` (``torch.optim``'s single-tensor arithmetic, reordered only
where an in-place multi-tensor form needs it; equal up to float rounding, tested against the
plain optimizers):

* SGD (``torch.optim.SGD``, ``dampening=0``): ``d = g + wd * p``; ``buf = momentum * buf + d``;
  ``d = d + momentum * buf`` (Nesterov) or ``d = buf``; ``p = p - lr * d``.
* AdamW (``torch.optim.AdamW``; Loshchilov & Hutter, https://arxiv.org/abs/1711.05101):
  ``p *= 1 - lr * wd``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2 * v + (1 - beta2) * g^2``;
  ``p += m / ((sqrt(v) / sqrt(1 - beta2^t) + eps) / -(lr / (1 - beta1^t)))``.
* Lion (``lion_pytorch.Lion``; Chen et al., "Symbolic Discovery of Optimization Algorithms",
  2023, https://arxiv.org/abs/2302.06675): ``p *= 1 - lr * wd``;
  ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``; ``m = beta2 * m + (1 - beta2) * g``.

Shape legend: K members; ``P``, ``G`` and each state list hold one ``(K, ...)`` tensor per
stacked parameter; a ``Hyper`` list holds per parameter one ``(K, 1, ..., 1)`` view of a
per-member value that broadcasts against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sweepmaster.workload.choices import OPTIMIZER_SETTINGS
from sweepmaster.workload.spec import OptimizerSpec

__all__ = ["OPTIMIZERS", "FusedStep", "OptimizerEntry", "optimizer_entry"]

#: A per-member value, one ``(K, 1, ..., 1)`` view per stacked parameter.
Hyper = list[Tensor]


@dataclass
class FusedStep:
    """One fused update's inputs: the tensors, the members and their values on the device.

    Attributes:
        params: The stacked parameters ``(K, ...)`` that have gradients.
        grads: Their gradients ``(K, ...)``; a step may use them as scratch (the trainer drops
            them after the step).
        state: State name -> one tensor ``(K, ...)`` per parameter (every name of
            :attr:`OptimizerEntry.state_keys` of any member).
        specs: The members' optimizers.
        lr_K: Each member's learning rate of this step, float64 ``(K,)`` on the device.
        steps_K: Each member's optimizer step count after this step, float64 ``(K,)`` on the
            device (bias corrections are computed from it there).
        member_K: ``member_K(name, values)``: a per-member hyperparameter, float64 ``(K,)``,
            made once on the device.
        per_param: ``per_param(x_K, dtype)``: a ``(K,)`` device tensor as a :data:`Hyper` list
            of ``dtype`` (float32 by default: ``torch.optim``'s compute type).
    """

    params: list[Tensor]
    grads: list[Tensor]
    state: dict[str, list[Tensor]]
    specs: list[OptimizerSpec]
    lr_K: Tensor
    steps_K: Tensor
    member_K: Callable[[str, Sequence[float]], Tensor]
    per_param: Callable[..., Hyper]

    def member(self, name: str, values: Sequence[float],
               dtype: torch.dtype = torch.float32) -> Hyper:
        """A per-member hyperparameter as a :data:`Hyper` list (made once on the device)."""
        return self.per_param(self.member_K(name, values), dtype)

    def neg_lr(self) -> Hyper:
        """``-lr`` per member."""
        return self.per_param(-self.lr_K)

    def decay(self, values: Sequence[float]) -> Hyper:
        """``1 - lr * value`` per member (decoupled weight decay's factor), from float64."""
        return self.per_param(1 - self.lr_K * self.member_K("weight_decay", values))


@dataclass(frozen=True)
class OptimizerEntry:
    """Everything about one optimizer that the rest of sweepmaster reads.

    Attributes:
        name: The name a sweep file and :class:`OptimizerSpec` use (``train.optimizer``).
        reference: The plain optimizer it equals and its source.
        settings: The ``OptimizerSpec`` fields (``train.*`` keys) it reads beyond the schedule.
        check: Raises ``ValueError`` for a spec the optimizer refuses (beyond the spec's own
            checks).
        state_keys: The state tensors (each shaped like its parameter) a parameter gets under
            a spec; the same names as the plain optimizer's state.
        step_counter: Whether the plain optimizer's state holds a ``step`` entry per parameter
            (a float32 0-dim tensor, as ``torch.optim.AdamW`` keeps it) beside the tensors.
        build: Builds the plain optimizer over parameters (one group).
        fused_step: Updates K stacked members in place (:class:`FusedStep`).
        step_scratch: ``step_scratch(param_bytes, foreach)``: bytes a step allocates above
            parameters, gradients and state, plain (``foreach``: the multi-tensor path) or
            fused, whichever is more.
    """

    name: str
    reference: str
    settings: tuple[str, ...]
    check: Callable[[OptimizerSpec], None]
    state_keys: Callable[[OptimizerSpec], tuple[str, ...]]
    step_counter: bool
    build: Callable[[Iterable[nn.Parameter], OptimizerSpec], torch.optim.Optimizer]
    fused_step: Callable[[FusedStep], None]
    step_scratch: Callable[[list[int], bool], int]

    def state_bytes(self, param_bytes: int, spec: OptimizerSpec) -> int:
        """Bytes of optimizer state a parameter of ``param_bytes`` bytes gets (planning)."""
        return len(self.state_keys(spec)) * param_bytes

    def fill_state(self, param: Tensor, state: dict[str, object], spec: OptimizerSpec) -> None:
        """Make the plain optimizer's state of ``param`` as its first step would (zeros).

        So that the state exists before the first step (a spilled job lays it out flat); the
        first step then gives exactly what it gives from no state.
        """
        if self.step_counter:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in self.state_keys(spec):
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)


# ---------------------------------------------------------------------------- scratch bytes


def _two_largest_or_all(param_bytes: list[int], foreach: bool) -> int:
    """AdamW's and SGD's step scratch: ``torch.optim``'s (the fused step's is none).

    The foreach path makes one temporary per parameter at once, the for-loop two of the
    largest; the fused step works in place.
    """
    if not param_bytes:
        return 0
    return sum(param_bytes) if foreach else 2 * max(param_bytes)


def _all_and_two_largest(param_bytes: list[int], foreach: bool) -> int:
    """Lion's step scratch: the plain step's or the fused step's, whichever is more.

    The plain step makes two temporaries of one parameter at a time, the fused step one per
    parameter at once (the signed interpolation).
    """
    del foreach
    if not param_bytes:
        return 0
    return max(sum(param_bytes), 2 * max(param_bytes))


# ---------------------------------------------------------------------------- SGD


def _check_sgd(spec: OptimizerSpec) -> None:
    if spec.nesterov and not spec.momentum > 0:
        raise ValueError("OptimizerSpec.nesterov=True needs momentum > 0 (SGD's Nesterov "
                         f"momentum), got momentum={spec.momentum!r}")


def _sgd_state(spec: OptimizerSpec) -> tuple[str, ...]:
    return ("momentum_buffer",) if spec.momentum != 0 else ()


def _build_sgd(params: Iterable[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                           weight_decay=spec.weight_decay, nesterov=spec.nesterov)


def _sgd_step(s: FusedStep) -> None:
    """SGD for K members: ``d`` is formed in the gradients, the buffer in place."""
    P, G, specs = s.params, s.grads, s.specs
    if any(spec.weight_decay != 0 for spec in specs):
        torch._foreach_addcmul_(G, P, s.member("weight_decay", [x.weight_decay for x in specs]))
    D = G
    if any(spec.momentum != 0 for spec in specs):
        B = s.state["momentum_buffer"]
        momentum = s.member("momentum", [x.momentum for x in specs])
        torch._foreach_mul_(B, momentum)
        torch._foreach_add_(B, G)
        nesterov = [x.nesterov for x in specs]
        if all(nesterov):
            torch._foreach_addcmul_(G, B, momentum)
        elif any(nesterov):  # d = 1 * d + momentum * buf, or 0 * d + 1 * buf (exactly buf)
            torch._foreach_mul_(G, s.member("nesterov", [float(n) for n in nesterov]))
            torch._foreach_addcmul_(G, B, s.member(
                "nesterov_momentum", [x.momentum if x.nesterov else 1.0 for x in specs]))
        else:
            D = B
    torch._foreach_addcmul_(P, D, s.neg_lr())


# ---------------------------------------------------------------------------- AdamW


def _no_check(spec: OptimizerSpec) -> None:
    del spec


def _adamw_state(spec: OptimizerSpec) -> tuple[str, ...]:
    del spec
    return ("exp_avg", "exp_avg_sq")


def _build_adamw(params: Iterable[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                             weight_decay=spec.weight_decay)


def _adamw_step(s: FusedStep) -> None:
    """AdamW for K members; the gradients become ``g^2``, then the step's denominator."""
    P, G, specs = s.params, s.grads, s.specs
    M, V = s.state["exp_avg"], s.state["exp_avg_sq"]
    if any(spec.weight_decay != 0 for spec in specs):
        torch._foreach_mul_(P, s.decay([x.weight_decay for x in specs]))
    torch._foreach_lerp_(M, G, s.member("one_minus_beta1", [1 - x.betas[0] for x in specs],
                                        M[0].dtype if M else torch.float32))
    torch._foreach_mul_(V, s.member("beta2", [x.betas[1] for x in specs]))
    torch._foreach_mul_(G, G)
    torch._foreach_addcmul_(V, G, s.member("one_minus_beta2", [1 - x.betas[1] for x in specs]))
    # Bias corrections on the device, in float64 like torch.optim's Python floats.
    beta1_K = s.member_K("beta1", [x.betas[0] for x in specs])
    beta2_K = s.member_K("beta2", [x.betas[1] for x in specs])
    neg_step_size_K = (s.lr_K / (1 - beta1_K.pow(s.steps_K))) * -1
    bias_correction2_sqrt_K = (1 - beta2_K.pow(s.steps_K)).sqrt()
    torch._foreach_zero_(G)
    torch._foreach_add_(G, V)
    torch._foreach_sqrt_(G)
    torch._foreach_div_(G, s.per_param(bias_correction2_sqrt_K))
    torch._foreach_add_(G, s.member("eps", [x.eps for x in specs]))
    torch._foreach_div_(G, s.per_param(neg_step_size_K))
    torch._foreach_addcdiv_(P, M, G)


# ---------------------------------------------------------------------------- Lion


def _check_lion(spec: OptimizerSpec) -> None:
    if not spec.lr > 0:
        raise ValueError(f"OptimizerSpec.lr must be > 0 for Lion, got {spec.lr!r}")


def _lion_state(spec: OptimizerSpec) -> tuple[str, ...]:
    del spec
    return ("exp_avg",)


def _build_lion(params: Iterable[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    from lion_pytorch import Lion

    return Lion(params, lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)


def _lion_step(s: FusedStep) -> None:
    """Lion for K members: one temporary per parameter (the signed interpolation)."""
    P, G, M, specs = s.params, s.grads, s.state["exp_avg"], s.specs
    if any(spec.weight_decay != 0 for spec in specs):
        torch._foreach_mul_(P, s.decay([x.weight_decay for x in specs]))
    update = torch._foreach_mul(M, s.member("beta1", [x.betas[0] for x in specs]))
    torch._foreach_addcmul_(update, G, s.member("one_minus_beta1",
                                                [1 - x.betas[0] for x in specs]))
    torch._foreach_sign_(update)
    torch._foreach_addcmul_(P, update, s.neg_lr())
    del update
    torch._foreach_mul_(M, s.member("beta2", [x.betas[1] for x in specs]))
    torch._foreach_addcmul_(M, G, s.member("one_minus_beta2", [1 - x.betas[1] for x in specs]))


# ---------------------------------------------------------------------------- the table

#: Every optimizer by name, in the order error messages list them.
OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry for entry in (
        OptimizerEntry(
            name="adamw", reference="torch.optim.AdamW",
            settings=OPTIMIZER_SETTINGS["adamw"],
            check=_no_check, state_keys=_adamw_state, step_counter=True, build=_build_adamw,
            fused_step=_adamw_step, step_scratch=_two_largest_or_all),
        OptimizerEntry(
            name="sgd", reference="torch.optim.SGD",
            settings=OPTIMIZER_SETTINGS["sgd"],
            check=_check_sgd, state_keys=_sgd_state, step_counter=False, build=_build_sgd,
            fused_step=_sgd_step, step_scratch=_two_largest_or_all),
        OptimizerEntry(
            name="lion", reference="lion_pytorch.Lion (lion-pytorch)",
            settings=OPTIMIZER_SETTINGS["lion"],
            check=_check_lion, state_keys=_lion_state, step_counter=False, build=_build_lion,
            fused_step=_lion_step, step_scratch=_all_and_two_largest),
    )
}


def optimizer_entry(name: str) -> OptimizerEntry:
    """The entry of optimizer ``name``.

    Raises:
        ValueError: No optimizer of that name.
    """
    entry = OPTIMIZERS.get(name)
    if entry is None:
        names = ", ".join(repr(n) for n in OPTIMIZERS)
        raise ValueError(f"optimizer name must be one of {names}, got {name!r}")
    return entry
