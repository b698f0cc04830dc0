"""Fused arrays: K same-architecture trials trained as one job (horizontal fusion).

HFTA (Wang et al., MLSys 2021, https://arxiv.org/abs/2102.02344) and mu-TWO (Purandare et al.,
MLSys 2023, https://arxiv.org/abs/2301.09313) train K models that share an architecture as one
array: every parameter is stacked to ``(K, ...)`` and one vmapped forward / backward runs the K
models as K-times-larger kernels. Here that is ``torch.func``: the members are built like
:func:`~sweepmaster.runtime.training.plain.train_plain` builds them (seed, then init), stacked with
``stack_module_state``, and run through a parameterless template module (built under
``torch.device("meta")``) with ``functional_call`` inside ``vmap``. A fused optimizer
(:mod:`~sweepmaster.runtime.training.fused_optim`) updates each member with its own
hyperparameters.

Exactness (DESIGN, "Exactness"). Each member reproduces its own plain training:

* Init, data order (``minibatch_indices`` with the member's seed), learning-rate schedule
  (``lr_factor`` per member), loss (``causal_lm_loss`` in float32), clipping (the member's own
  global norm) and evaluation are the plain recipe's, per member.
* Without dropout, a member's loss and gradients equal separate training up to float rounding of
  batched kernels (tested allclose 1e-6), so its weights match plain training (SGD allclose 1e-6;
  AdamW within an lr-scaled tolerance, Adam's normalisation amplifies 1e-7 differences).
* Dropout is per member and not drawn by ``vmap``: member k owns a generator holding exactly the
  random stream plain training would draw its dropout from (on the CPU: the CPU generator as left
  by its seeded init). Before each step the array draws every dropout noise tensor (the
  ``(bernoulli(1 - p) / (1 - p))`` of ``torch.dropout``, same shapes, strides and order, found by
  a probe forward at construction) from each member's generator, and a ``TorchFunctionMode``
  replays them inside the vmapped forward for ``F.dropout`` and for the dropout of
  ``F.scaled_dot_product_attention`` (then computed as ATen's math attention). On the CPU a member
  with dropout therefore equals its plain training (allclose), independently of the other members
  and of members leaving. On CUDA, plain dropout uses fused Philox kernels this cannot replay:
  members draw independent streams from per-member CUDA generators seeded with their seeds, but
  do not equal plain training. Any other random op in the model (caught by the probe) refuses to
  fuse.
* GPT-2 weight tying: ``stack_module_state`` stacks a tied parameter once (``named_parameters``
  skips duplicates); ``functional_call`` sees the template's tie (intact because the template is
  built on the meta device, not moved there) and feeds the one stacked tensor to both uses, so it
  receives both gradient contributions and one update.

* LoRA (multi-LoRA training over one shared frozen base: mLoRA / ASPEN, VLDB 2025;
  LoRAFusion): members with one :func:`~sweepmaster.workload.architecture.fusion_key` may differ
  in rank, alpha and dropout. The frozen base (every parameter with ``requires_grad=False``) is
  held once, unstacked, and passed to ``vmap`` with ``in_dims=None``; only the adapters are
  stacked. Member k's ``A`` ``(r_k, in)`` and ``B`` ``(out, r_k)`` are zero-padded to the
  largest rank R: ``B_pad A_pad = B A``, and the padded rows of ``A`` and columns of ``B`` get
  exactly zero gradient (each is a product with the other's zero padding), so AdamW (weight
  decay included) and SGD keep them exactly zero. Each member's scaling ``alpha_k / r_k``
  replaces PEFT's per-layer scaling inside the vmapped forward, and its adapter dropout ``p_k``
  is drawn per member like any other dropout (``p_k = 0``: no draw, as PEFT's ``nn.Identity``).
  A member leaves with its unpadded adapter (saved in PEFT's format). Members of one base
  (source, dtype, seed) build it once
  (:class:`~sweepmaster.runtime.training.members.SharedBases`): the base is initialized for
  the first, the host generator's state after its init is kept, and every member's adapter is
  drawn from that state over a copy sharing the base's tensors, which is exactly what building
  the member alone gives (its adapter's init continues the stream its base's init drew from).
  A member of another base (a pretrained one, another seed) is built whole and its frozen
  weights checked equal to the array's and dropped. On the CPU the array keeps its base, so a
  joining member of the same base builds only its adapter too.

* Refill: members leave (:meth:`FusedArray.remove_member`) and join
  (:meth:`FusedArray.join`) between steps. A joining member is built exactly as it would be
  alone (seeded init, its own data order, schedule, dropout stream and step count) and stacked
  last; its optimizer state starts as zeros, which is the state ``torch.optim`` starts from; a
  larger LoRA rank re-pads every adapter (and its optimizer state) with zeros, which stay zero.
  A join that fails (out of memory, say) leaves the array as it was.
  Members never see each other's slices, so each, joined late or not, ends with the weights of
  training it alone. :func:`train_fused` asks a refill hook for new members whenever slots are
  free, so an array keeps K members busy while a sweep has trials to give.

How members are built, padded and given their dropout noise, and their bookkeeping, is
:mod:`~sweepmaster.runtime.training.members` (shared with spilled fused arrays).
How many members to fuse is :mod:`~sweepmaster.runtime.planning.fusion_degree`'s question. The
executor trains an array by stacked-shard tasks
(:class:`~sweepmaster.runtime.execution.fused_jobs.SpilledFusedRun`, one stacked shard when it
fits its device); :func:`train_fused` is the reference it is tested against, and
:func:`~sweepmaster.runtime.planning.fusion_degree.measure_fusion` times :class:`FusedArray`'s
steps.

Shape legend: K members, B batch (blocks), T tokens per block, V vocabulary, M eval blocks,
R the largest LoRA rank of the members.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from sweepmaster.runtime.devices.device import Device
from sweepmaster.runtime.execution.events import StartEvent, TrainCallbacks
from sweepmaster.runtime.training.checkpoint import (
    TrainingState,
    capture_rng,
    job_key,
    load_latest,
    save_checkpoint,
)
from sweepmaster.runtime.training.fused_optim import (
    build_fused_optimizer,
    clip_grad_norm_per_member_,
)
from sweepmaster.runtime.training.members import (
    DropoutReplay,
    Member,
    MemberRun,
    NoiseSite,
    SeededOpDetector,
    SharedBases,
    load_member,
    lora_layers,
    lora_scale,
    lora_scaling,
    marking_adapter_dropout,
    member_noise,
    meta_template,
    padded_adapter,
    same_tensors,
    tied_aliases,
    unpad,
    zero_pad,
)
from sweepmaster.runtime.training.plain import (
    _check,
    lr_factor,
)
from sweepmaster.workload.architecture import fusion_key
from sweepmaster.workload.models import (
    causal_lm_loss,
)
from sweepmaster.workload.spec import TrainResult, TrainSpec

# Under vmap the CPU flash-attention kernel runs once per member (functorch's fallback loop), which
# is the per-member kernel plain training runs; its "performance drop" warning is noise here.
warnings.filterwarnings(
    "ignore",
    message=r"There is a performance drop because we have not yet implemented the batching rule "
    r"for aten::_scaled_dot_product_flash_attention_for_cpu",
    category=UserWarning,
)

__all__ = [
    "FusedArray",
    "FusedMemberError",
    "FusedStep",
    "MemberEndHook",
    "RefillHook",
    "train_fused",
]


class FusedMemberError(RuntimeError):
    """Members of a fused array failed; the others trained to the end.

    A member fails alone when its train loss turns non-finite (a ``FloatingPointError``, as
    ``train_plain`` raises), one of its callbacks raises, or saving its checkpoint does.

    Attributes:
        results: Per member of the array, in input order (then joining order): its result, or
            ``None`` if it failed.
        errors: Member index to its error.
    """

    def __init__(
        self, results: list[TrainResult | None], errors: dict[int, Exception]
    ) -> None:
        self.results = results
        self.errors = errors
        super().__init__("; ".join(str(error) for error in errors.values()))


@dataclass(frozen=True)
class FusedStep:
    """What one :meth:`FusedArray.step` did, per current member (in array order).

    Attributes:
        losses: Train loss (mean token cross entropy, nats) of each member's minibatch.
        lrs: Learning rate each member used.
        epochs: Zero-based epoch of each member's minibatch.
    """

    losses: list[float]
    lrs: list[float]
    epochs: list[int]


class FusedArray:
    """K same-architecture members stacked and trained as one (HFTA, mu-TWO horizontal fusion).

    Members are built in order, each seeded with its own ``seed`` like plain training, stacked
    (trainable params ``(K, ...)``, a LoRA adapter zero-padded to rank R; the frozen base once,
    unstacked), and from then on advance together: :meth:`step` trains every member
    one optimizer step on its own minibatch; :meth:`remove_member` takes one out (pruned, failed,
    finished) and the others continue with unchanged state; :meth:`join` adds one between steps
    (refill), built as it would be alone. See the module doc for exactness.

    Not thread-safe: one thread drives an array.

    Example:
        >>> from transformers import GPT2Config
        >>> config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
        >>> blocks_NT = torch.randint(0, 64, (8, 16))
        >>> specs = [TrainSpec(config, blocks_NT, batch_size=4, seed=s) for s in (0, 1)]
        >>> array = FusedArray(specs, Device("cpu"))
        >>> len(array.step().losses)  # one loss per member
        2
        >>> _ = array.remove_member(0)  # trial 0 leaves (its weights); trial 1 goes on
        >>> len(array.step().losses)
        1

    Args:
        specs: The members, K >= 1. For K > 1 they share one
            :func:`~sweepmaster.workload.architecture.fusion_key` and optimizer name.
        device: Where the stacked parameters, optimizer state and activations live.
        states: Per member, a training-state checkpoint to continue from
            (:func:`~sweepmaster.runtime.training.checkpoint.load_latest`: written by any path) or
            ``None`` to start at step 0; ``None``: every member starts at step 0. Members may
            resume from different steps; each continues its own data order, LR schedule,
            optimizer step count and dropout stream from its checkpoint.

    Attributes:
        params: Stacked trainable parameters ``(K, ...)`` by name (a tied parameter once, under
            the name ``named_parameters`` gives it; LoRA ``A`` ``(K, R, in)`` and ``B``
            ``(K, out, R)``), leaves; ``.grad`` is set during :meth:`step` only.
        frozen: The frozen parameters (``requires_grad=False``: a LoRA base) by name, held once
            for all members, unstacked; empty for full fine-tuning.
        buffers: Stacked buffers ``(K, ...)`` by name.
        num_steps: Optimizer steps the array has taken (every member takes each of them).

    Raises:
        ValueError: No members, members that do not share a fusion key or optimizer name, or
            whose frozen parameters differ, an invalid optimizer spec, or a model drawing random
            numbers other than dropout.
    """

    def __init__(
        self,
        specs: Sequence[TrainSpec],
        device: Device,
        states: Sequence[TrainingState | None] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a fused array needs at least one member")
        states = list(states) if states is not None else [None] * len(specs)
        if len(states) != len(specs):
            raise ValueError(f"{len(specs)} specs but {len(states)} states")
        if len(specs) > 1 and len({fusion_key(spec) for spec in specs}) != 1:
            raise ValueError("members of a fused array must share one architecture key (LoRA: "
                             "one base and target modules)")
        self._torch_device = device.torch_device
        self._meter = device.meter
        self._fusion_key = fusion_key(specs[0])
        self._adapter = padded_adapter(specs)
        with self._host_copies():  # meta tensors hold no bytes; a meter would count their size
            self._template = meta_template(specs[0], self._adapter)
        padded = {name: p.shape for name, p in self._template.named_parameters()}
        member_params: list[dict[str, Tensor]] = []
        member_buffers: list[dict[str, Tensor]] = []
        frozen: dict[str, Tensor] | None = None
        self._members: list[Member] = []
        self._bases = SharedBases()
        for spec, state in zip(specs, states, strict=True):
            member, trainable, buffers, base = load_member(spec, state, self._torch_device,
                                                            self._bases)
            if frozen is None:
                frozen = base
            elif not same_tensors(frozen, base):
                raise ValueError(f"member {spec.name!r} has other frozen weights than "
                                 f"{specs[0].name!r}: a fused array holds one frozen base")
            member_params.append({name: zero_pad(p, padded[name])
                                  for name, p in trainable.items()})
            member_buffers.append(buffers)
            self._members.append(member)
        self.params: dict[str, Tensor] = {
            name: torch.stack([params[name] for params in member_params])
            .to(self._torch_device).requires_grad_(True)
            for name in member_params[0]
        }
        self.frozen: dict[str, Tensor] = {
            name: p.to(self._torch_device) for name, p in (frozen or {}).items()
        }
        self.buffers: dict[str, Tensor] = {
            name: torch.stack([buffers[name] for buffers in member_buffers])
            .to(self._torch_device)
            for name in member_buffers[0]
        }
        del member_params, member_buffers, frozen
        self._release_bases()
        self._scaling_K = torch.tensor([lora_scale(spec) for spec in specs], dtype=torch.float32,
                                       device=self._torch_device)
        self._optimizer = build_fused_optimizer(
            [spec.optimizer for spec in specs], self._torch_device
        )
        for index, state in enumerate(states):
            if state is not None:
                self._optimizer.load_member_state(
                    index, self._trainable(), state.optimizer, self._trainable_names()
                )
        self._retemplated()
        self.num_steps = 0

    def _retemplated(self) -> None:
        """Derive what depends on the template: LoRA layers, tied names, dropout sites."""
        adapted = self._adapter is not None
        self._lora_layers = lora_layers(self._template) if adapted else []
        self._aliases = tied_aliases(self._template)
        self._noise_sites = self._probe_dropout(self._members[0].spec)

    @property
    def num_members(self) -> int:
        """K, the members currently in the array."""
        return len(self._members)

    @property
    def specs(self) -> list[TrainSpec]:
        """The current members' specs, in array order."""
        return [member.spec for member in self._members]

    @property
    def member_steps(self) -> list[int]:
        """Optimizer steps each current member has done (earlier runs' included), array order."""
        return [member.step for member in self._members]

    def member_num_parameters(self, index: int) -> int:
        """Trainable parameters of member ``index`` (a tied parameter counted once, unpadded)."""
        return sum(shape.numel() for shape in self._members[index].shapes.values())

    def step(self) -> FusedStep:
        """Train every member one optimizer step on its next minibatch (the plain recipe, fused).

        Returns:
            Per member: train loss, learning rate and epoch of the step.

        Raises:
            RuntimeError: The array has no members.
        """
        if not self._members:
            raise RuntimeError("the fused array has no members left")
        epochs, rows = [], []
        for member in self._members:
            epoch, index_B = next(member.batches)
            epochs.append(epoch)
            rows.append(member.spec.train_data[index_B])
        input_ids_KBT = torch.stack(rows).to(self._torch_device)
        lrs = [
            member.spec.optimizer.lr
            * lr_factor(member.step, member.spec.optimizer, member.spec.total_steps)
            for member in self._members
        ]
        loss_K = self.forward_backward(input_ids_KBT)
        trainable = self._trainable()
        max_norms = [spec.optimizer.grad_clip for spec in self.specs]
        if any(norm is not None for norm in max_norms):
            clip_grad_norm_per_member_(trainable, max_norms)
        self._optimizer.step(trainable, lrs)
        for p in trainable:
            p.grad = None
        self.num_steps += 1
        for member in self._members:
            member.step += 1
        return FusedStep(losses=loss_K.tolist(), lrs=lrs, epochs=epochs)

    def forward_backward(self, input_ids_KBT: Tensor) -> Tensor:
        """One vmapped forward and backward; accumulates each member's gradient into ``params``.

        Draws each member's dropout noise for this forward from its own generator.

        Args:
            input_ids_KBT: int64 token ids ``(K, B, T)`` on the array's device, member k's
                minibatch at index k.

        Returns:
            ``loss_K``, float32 (detached), each member's mean token cross entropy.
        """
        noises = [self._draw_noise(site) for site in self._noise_sites]

        def member_loss(
            params: dict[str, Tensor],
            frozen: dict[str, Tensor],
            buffers: dict[str, Tensor],
            scaling: Tensor,
            ids_BT: Tensor,
            noises: list[Tensor],
        ) -> Tensor:
            with DropoutReplay(noises) if noises else contextlib.nullcontext():
                logits_BTV = self._logits(params, frozen, buffers, scaling, ids_BT)
            return causal_lm_loss(logits_BTV, ids_BT)

        self._template.train()
        # The frozen base is one tensor per name for all members: not batched (in_dims None).
        loss_K = vmap(member_loss, in_dims=(0, None, 0, 0, 0, 0), randomness="error")(
            self.params, self.frozen, self.buffers, self._scaling_K, input_ids_KBT, noises
        )
        loss_K.sum().backward()
        return loss_K.detach()

    def evaluate(self, members: Sequence[int] | None = None) -> list[float]:
        """Mean next-token loss (nats per token) of members on their validation blocks.

        Like :func:`~sweepmaster.runtime.training.plain.evaluate_loss` per member: eval mode, no
        grad, the first ``eval_max_blocks`` blocks in order in batches of ``batch_size``, each
        batch weighted by its predicted tokens. Draws no random numbers. Members whose validation
        blocks have the same shape are evaluated in one vmapped pass.

        Args:
            members: Positions in the array; ``None``: all.

        Returns:
            The losses, in the order of ``members``.

        Raises:
            ValueError: A member has no ``eval_data``.
        """
        positions = list(range(self.num_members)) if members is None else list(members)
        blocks = {k: _eval_blocks(self._members[k].spec) for k in positions}
        losses: dict[int, float] = {}
        self._template.eval()
        try:
            for shape in dict.fromkeys(tuple(b.shape) for b in blocks.values()):
                group = [k for k in positions if tuple(blocks[k].shape) == shape]
                losses.update(zip(group, self._evaluate_group(group, blocks), strict=True))
        finally:
            self._template.train()
        return [losses[k] for k in positions]

    def member_state_dict(self, index: int) -> dict[str, Tensor]:
        """Member ``index``'s weights as its own model's ``state_dict()`` (host copies).

        Keys are those of the model's ``state_dict`` (a tied weight under each of its names).

        Raises:
            IndexError: No such member.
        """
        self._check_index(index)
        state: dict[str, Tensor] = {}
        with self._host_copies():
            for name in self._template.state_dict(keep_vars=True):
                source = self._aliases.get(name, name)
                state[name] = self._member_tensor(index, source).to("cpu", copy=True)
        return state

    def member_training_state(self, index: int) -> TrainingState:
        """Member ``index``'s training state, as an unfused trial's checkpoint holds it.

        Weights (:meth:`member_state_dict`), its slice of the fused optimizer's state per
        parameter name, its step and its dropout stream; ``metrics`` and ``elapsed_s`` are
        left for the caller to fill in. Call it between steps.

        Raises:
            IndexError: No such member.
        """
        self._check_index(index)
        member = self._members[index]
        shapes = member.shapes
        with self._host_copies():
            optimizer = {
                name: {k: unpad(v, shapes[name]).to("cpu") if isinstance(v, Tensor) and v.dim()
                       else v for k, v in entry.items()}
                for name, entry in self._optimizer.member_state(
                    index, self._trainable_names()
                ).items()
            }
        return TrainingState(
            step=member.step,
            model=self.member_state_dict(index),
            optimizer=optimizer,
            rng=capture_rng(self._torch_device, member.generator),
        )

    def member_module(self, index: int) -> nn.Module:
        """A standalone CPU model holding member ``index``'s weights (e.g. to checkpoint it).

        A LoRA member's model carries its own unpadded adapter and PEFT config (rank, alpha,
        dropout), so it saves in PEFT's format like the member trained alone; on the CPU its
        frozen base shares the array's tensors (not copied).

        Raises:
            IndexError: No such member.
        """
        self._check_index(index)
        tensors: dict[str, Tensor] = {}
        with self._host_copies():
            for name in {**self.params, **self.frozen, **self.buffers}:
                value = self._member_tensor(index, name).to("cpu", copy=name not in self.frozen)
                is_param = name not in self.buffers
                tensors[name] = nn.Parameter(value, name in self.params) if is_param else value
        for alias, canonical in self._aliases.items():
            tensors[alias] = tensors[canonical]  # tied: one tensor under both names
        spec = self._members[index].spec
        with self._host_copies():  # meta tensors, then host copies
            module = (copy.deepcopy(self._template) if spec.peft is None
                      else meta_template(spec, spec.peft))
        for name, tensor in tensors.items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, tensor)
        return module.train()

    def remove_member(self, index: int) -> dict[str, Tensor]:
        """Unfuse: member ``index`` leaves; the others keep their exact state and go on.

        Their parameters, buffers, optimizer state, data order and dropout streams are
        unchanged, so they continue exactly as if the member had never been in the array.

        Args:
            index: Position in the array.

        Returns:
            The leaving member's weights (:meth:`member_state_dict`).

        Raises:
            IndexError: No such member.
        """
        state = self.member_state_dict(index)
        keep_K = torch.tensor(
            [k for k in range(self.num_members) if k != index],
            dtype=torch.long,
            device=self._torch_device,
        )
        with torch.no_grad():
            self.params = {
                name: p.index_select(0, keep_K).requires_grad_(p.requires_grad)
                for name, p in self.params.items()
            }
            self.buffers = {name: b.index_select(0, keep_K) for name, b in self.buffers.items()}
            self._scaling_K = self._scaling_K.index_select(0, keep_K)
        self._optimizer.remove_member(index)
        self._members.pop(index)
        return state

    def join(self, spec: TrainSpec, state: TrainingState | None = None) -> int:
        """Refill: a new member joins the array between steps, built as it would be alone.

        It is built like every member (seeded init, its own data order, learning-rate schedule,
        dropout stream and step count, or those of ``state``) and stacked last into every tensor;
        its optimizer state starts as a fresh ``torch.optim``'s (zeros, step 0). A LoRA adapter
        of a larger rank than the array's R (or the first adapter with dropout) re-pads the
        array: every adapter and its optimizer state are zero-padded to the new R, which keeps
        the other members exact (module doc, LoRA). The others' state is unchanged, so every
        member, the joined one included, ends with the weights of training it alone.

        A join is all or nothing: whatever it raises (out of memory while the grown tensors
        are built, a checkpoint that does not fit), the array is left exactly as it was and
        trains on. It checks no budget beforehand: ``Executor.join_fused`` does, and refuses a
        member whose grown array would not fit its device.

        Args:
            spec: The new member, of the array's
                :func:`~sweepmaster.workload.architecture.fusion_key` and optimizer name.
            state: A training-state checkpoint to continue from, or ``None`` (step 0).

        Returns:
            The new member's position in the array (the last).

        Raises:
            ValueError: ``spec`` does not share the array's fusion key, optimizer name or
                frozen weights, or its optimizer spec is invalid.
            RuntimeError: ``state`` does not fit the member (tensors of other shapes).
            torch.OutOfMemoryError: The grown array does not fit the device's memory.
        """
        if fusion_key(spec) != self._fusion_key:
            raise ValueError(f"member {spec.name!r} cannot join: a fused array's members share "
                             "one architecture key (LoRA: one base and target modules)")
        member, trainable, buffers, base = load_member(spec, state, self._torch_device,
                                                        self._bases)
        self._release_bases()
        if not same_tensors(self.frozen, base):
            raise ValueError(f"member {spec.name!r} has other frozen weights than the array: a "
                             "fused array holds one frozen base")
        del base
        adapter = padded_adapter([*self.specs, spec])
        grown = adapter is not None and (
            self._adapter is None or adapter.r > self._adapter.r
            or (adapter.dropout > 0) != (self._adapter.dropout > 0))
        template = self._template
        if grown:
            with self._host_copies():
                template = meta_template(spec, adapter)
        padded = {name: p.shape for name, p in template.named_parameters()}
        with torch.no_grad():  # the grown tensors; the array's own are untouched until all exist
            params = {
                name: torch.cat([
                    zero_pad(p.detach(), torch.Size((p.shape[0], *padded[name]))),
                    zero_pad(trainable[name], padded[name]).unsqueeze(0).to(p.device, p.dtype),
                ]).requires_grad_(True)
                for name, p in self.params.items()
            }
            buffers_K = {
                name: torch.cat([b, buffers[name].unsqueeze(0).to(b.device, b.dtype)])
                for name, b in self.buffers.items()
            }
            scaling_1 = torch.tensor([lora_scale(spec)], dtype=torch.float32,
                                     device=self._torch_device)
            scaling_K = torch.cat([self._scaling_K, scaling_1])
        index = self.num_members
        before = (self.params, self.buffers, self._scaling_K, self._adapter, self._template,
                  self._lora_layers, self._aliases, self._noise_sites)
        undo_optimizer = self._optimizer.undo_point()
        try:
            self._optimizer.add_member(spec.optimizer, list(params.values()))
            if state is not None:
                self._optimizer.load_member_state(index, list(params.values()), state.optimizer,
                                                  list(params))
            self.params, self.buffers, self._scaling_K = params, buffers_K, scaling_K
            self._members.append(member)
            if grown:
                self._adapter, self._template = adapter, template
                self._retemplated()
        except BaseException:
            undo_optimizer()
            del self._members[index:]
            (self.params, self.buffers, self._scaling_K, self._adapter, self._template,
             self._lora_layers, self._aliases, self._noise_sites) = before
            raise
        return index

    def _release_bases(self) -> None:
        """Keep the members' base only where the array holds its tensors anyway.

        That is a LoRA base on the CPU (``frozen`` is the base's memory); elsewhere a kept base
        would be a second, host copy (a full fine-tuning member's init, a base moved to a GPU,
        a base the first member's checkpoint was loaded into a copy of).
        """
        if not self._bases.shares(self.frozen):
            self._bases.clear()

    def _trainable(self) -> list[Tensor]:
        return list(self.params.values())

    def _trainable_names(self) -> list[str]:
        return list(self.params)

    def _member_tensor(self, index: int, name: str) -> Tensor:
        """Member ``index``'s tensor ``name`` (unpadded; the shared one if frozen), detached."""
        if name in self.frozen:
            return self.frozen[name].detach()
        if name in self.params:
            return unpad(self.params[name][index].detach(), self._members[index].shapes[name])
        return self.buffers[name][index]

    def _logits(self, params: dict[str, Tensor], frozen: dict[str, Tensor],
                buffers: dict[str, Tensor], scaling: Tensor, ids_BT: Tensor) -> Tensor:
        """``logits_BTV`` of one member (or the vmapped members), LoRA scaled by ``scaling``."""
        with lora_scaling(self._lora_layers, scaling):
            return _call_logits(self._template, {**frozen, **params}, buffers, ids_BT)

    def _host_copies(self) -> contextlib.AbstractContextManager[None]:
        """Host copies and meta tensors are no device memory (for a virtual device's meter)."""
        return self._meter.unmetered() if self._meter is not None else contextlib.nullcontext()

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_members:
            raise IndexError(f"member {index} out of range for {self.num_members} members")

    def _draw_noise(self, site: NoiseSite) -> Tensor:
        """``(K, *site.shape)`` dropout noise, member k's slice drawn from its generator.

        At an adapter's site member k drops with its own ``peft.dropout``; with 0 it draws
        nothing (PEFT's ``nn.Identity``) and its slice is ones.
        """
        noise_K = torch.empty_strided((self.num_members, *site.shape),
                                      (math.prod(site.shape), *site.stride), dtype=site.dtype,
                                      device=self._torch_device)
        for k, member in enumerate(self._members):  # drawn in place: no stacking copy
            member_noise(site, member.spec, member.generator, self._torch_device,
                          out=noise_K[k])
        return noise_K

    def _evaluate_group(self, group: list[int], blocks: dict[int, Tensor]) -> list[float]:
        index_G = torch.tensor(group, device=self._torch_device)
        batch_size = self._members[group[0]].spec.batch_size
        num_blocks = int(blocks[group[0]].shape[0])
        loss_sum_G = torch.zeros(len(group), dtype=torch.float64, device=self._torch_device)
        num_tokens = 0

        def member_loss(
            params: dict[str, Tensor], frozen: dict[str, Tensor], buffers: dict[str, Tensor],
            scaling: Tensor, ids_BT: Tensor
        ) -> Tensor:
            logits_BTV = self._logits(params, frozen, buffers, scaling, ids_BT)
            return causal_lm_loss(logits_BTV, ids_BT)

        with torch.no_grad():
            params, buffers, scaling_G = self.params, self.buffers, self._scaling_K
            if group != list(range(self.num_members)):
                params = {n: p.index_select(0, index_G) for n, p in params.items()}
                buffers = {n: b.index_select(0, index_G) for n, b in buffers.items()}
                scaling_G = scaling_G.index_select(0, index_G)
            for start in range(0, num_blocks, batch_size):
                ids_GBT = torch.stack([blocks[k][start : start + batch_size] for k in group])
                ids_GBT = ids_GBT.to(self._torch_device)
                batch_tokens = ids_GBT.shape[1] * (ids_GBT.shape[2] - 1)
                loss_G = vmap(member_loss, in_dims=(0, None, 0, 0, 0), randomness="error")(
                    params, self.frozen, buffers, scaling_G, ids_GBT)
                loss_sum_G += loss_G.double() * batch_tokens
                num_tokens += batch_tokens
        return [float(v) / num_tokens for v in loss_sum_G.tolist()]

    def _probe_dropout(self, spec: TrainSpec) -> list[NoiseSite]:
        """Record the dropout draws of one training forward (member 0, zeros input).

        Raises:
            ValueError: The forward draws random numbers other than dropout.
        """
        params = {n: p[0].detach() for n, p in self.params.items()}
        buffers = {n: b[0] for n, b in self.buffers.items()}
        ids_BT = torch.zeros(
            spec.batch_size,
            int(spec.train_data.shape[1]),
            dtype=torch.long,
            device=self._torch_device,
        )
        recorder = DropoutReplay(None)
        detector = SeededOpDetector()
        self._template.train()
        with torch.no_grad(), recorder, detector, marking_adapter_dropout(self._lora_layers,
                                                                          recorder):
            self._logits(params, self.frozen, buffers, self._scaling_K[0], ids_BT)
        if detector.ops:
            raise ValueError(
                f"job {spec.name!r} cannot fuse: its forward draws random numbers outside "
                f"dropout ({', '.join(sorted(detector.ops))}), which a fused array cannot "
                "reproduce per member"
            )
        return recorder.sites


#: Called when a member leaves its fused array: ``(index, result, error)``, one of the last two
#: ``None``; the index is in ``specs``, then in joining order (see :func:`train_fused`).
MemberEndHook = Callable[[int, TrainResult | None, Exception | None], None]

#: Asked at a step boundary where a fused array has free slots (members left it):
#: ``(free slots, the array's steps so far)`` -> at most that many new members to join it, each
#: its spec and progress receiver (see :func:`train_fused`).
RefillHook = Callable[[int, int], Sequence[tuple[TrainSpec, TrainCallbacks | None]]]


def train_fused(
    specs: Sequence[TrainSpec],
    device: Device,
    callbacks: Sequence[TrainCallbacks | None] | None = None,
    *,
    on_member_end: MemberEndHook | None = None,
    refill: RefillHook | None = None,
) -> list[TrainResult]:
    """Train K same-architecture trials as one fused array; each gets ``train_plain``'s result.

    Per member, the events (``on_start``, ``on_eval`` at step 0 / every ``eval_every`` / the
    end, ``on_step``), metrics, objective, pruning and checkpoint are those of
    :func:`~sweepmaster.runtime.training.plain.train_plain`; ``tokens_per_s`` is the member's own
    tokens over the fused step's wall time. A member leaves the array (unfuse) when its callback
    prunes it, when it reaches its ``total_steps``, or when it fails: its loss turns non-finite,
    one of its callbacks raises an ``Exception``, or saving its checkpoint does. The others go on
    with unchanged state. (A ``BaseException`` such as ``KeyboardInterrupt`` ends the whole array.)

    Checkpoints (:mod:`~sweepmaster.runtime.training.checkpoint`), per member as in
    ``train_plain``: a member with ``state_dir`` resumes from the newest intact checkpoint of its
    job there (written fused or by any other path), and with ``checkpoint_every`` writes its own
    training state there (weights, its slice of the fused optimizer's state, step, dropout
    stream, metrics) after every that many steps, after that step's evaluation. Members of one
    array may resume from different steps; none repeats a step, evaluation or event it
    checkpointed, and each ends with the weights of an uninterrupted run.

    Refill: with ``refill``, the array keeps its K = ``len(specs)`` slots busy. At every step
    boundary where members have left it, ``refill`` is asked for as many new members as slots
    are free; each joins (:meth:`FusedArray.join`: its own init, data order, schedule, dropout
    stream and step count, or its checkpoint's), gets ``on_start`` and its step-0 evaluation,
    and from the next step trains in the array, ending like ``train_plain`` too. The array ends
    when no member is left and ``refill`` gives none. Without it the others run on alone.

    Example:
        >>> from transformers import GPT2Config
        >>> config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
        >>> blocks_NT = torch.randint(0, 64, (8, 16))
        >>> specs = [
        ...     TrainSpec(config, blocks_NT, batch_size=4, max_steps=steps, seed=steps)
        ...     for steps in (2, 3)
        ... ]
        >>> [result.steps for result in train_fused(specs, Device("cpu"))]
        [2, 3]
        >>> late = [(TrainSpec(config, blocks_NT, batch_size=4, max_steps=2, seed=7), None)]
        >>> [r.steps for r in train_fused(specs, Device("cpu"),
        ...                               refill=lambda free, step: late if step == 2 else [])]
        [2, 3, 2]

    Args:
        specs: The members (see :class:`FusedArray`).
        device: Where the array trains.
        callbacks: One progress receiver (or ``None``) per member; ``None``: no callbacks.
        on_member_end: Called as soon as a member leaves the array, with its index (in
            ``specs``, then ``len(specs)`` onwards for members that joined, in joining order)
            and its result (finished or pruned) or its error; e.g. to hand each trial's result
            on while the others still train. Runs on the training thread.
        refill: Asked for members to join when slots are free (:data:`RefillHook`); runs on
            the training thread. A member that cannot join (another architecture, say) fails
            alone.

    Returns:
        One result per member, in the order of ``specs`` and then of joining.

    Raises:
        ValueError: See :class:`FusedArray`; also a member with blocks shorter than 2 tokens,
            empty ``eval_data`` or ``eval_every < 1``, or a callback list of another length.
        FusedMemberError: Some members failed; ``results`` holds the others' results,
            ``errors`` each failure (a non-finite loss names the job and the step, a training
            state that cannot be written its ``OSError``).
    """
    callbacks = list(callbacks) if callbacks is not None else [None] * len(specs)
    if len(callbacks) != len(specs):
        raise ValueError(f"{len(specs)} specs but {len(callbacks)} callbacks")
    runs = [
        MemberRun(index, spec, callback if callback is not None else TrainCallbacks())
        for index, (spec, callback) in enumerate(zip(specs, callbacks, strict=True))
    ]
    for run in runs:
        _check(run.spec, int(run.spec.train_data.shape[1]), run.eval_data)
    torch_device = device.torch_device

    def load_state(run: MemberRun) -> TrainingState | None:
        run.key = job_key(run.spec) if run.spec.state_dir is not None else ""
        state = load_latest(run.spec.state_dir, run.key, torch_device.type) if run.key else None
        if state is not None:
            run.step, run.earlier_s, run.metrics = state.step, state.elapsed_s, list(state.metrics)
        return state

    array = FusedArray(specs, device, [load_state(run) for run in runs])
    live = list(runs)  # live[k] is member k of the array
    num_slots = len(runs)
    save_seconds = 0.0
    errors: dict[int, Exception] = {}

    def start(k: int) -> None:
        run = live[k]
        run.started, run.save_s_before = time.perf_counter(), save_seconds
        run.call(
            run.callbacks.on_start,
            StartEvent(run.spec.name, run.spec.total_steps, device.name,
                       array.member_num_parameters(k), resumed_from_step=run.step),
        )

    def seconds(run: MemberRun) -> float:
        saving = save_seconds - run.save_s_before
        return run.earlier_s + time.perf_counter() - run.started - saving

    def evaluate_due(joining: Sequence[MemberRun] | None) -> None:
        # None: after a step, every member due. Members joining (at the start: all) evaluate
        # at step 0 only: a resumed one did before its checkpoint.
        due = [k for k, run in enumerate(live) if run.eval_due(run.step)
               and (joining is None or (run in joining and run.step == 0))]
        if due:
            for k, eval_loss in zip(due, array.evaluate(due), strict=True):
                live[k].record_eval(live[k].step, eval_loss)

    def save_due() -> None:
        nonlocal save_seconds
        save_start = time.perf_counter()
        for k, run in enumerate(live):
            every = run.spec.checkpoint_every
            if every is None or run.error is not None or run.pruned or run.step % every:
                continue
            state = array.member_training_state(k)
            state.metrics, state.elapsed_s = list(run.metrics), seconds(run)
            assert run.spec.state_dir is not None
            try:
                save_checkpoint(run.spec.state_dir, state, run.key,
                                keep=run.spec.keep_checkpoints)
            except OSError as exc:  # e.g. a full disk: this member fails alone
                run.error = exc
        save_seconds += time.perf_counter() - save_start

    def ended(run: MemberRun) -> None:
        if run.error is not None:
            run.result = None
            errors[run.index] = run.error
        if on_member_end is not None:
            on_member_end(run.index, run.result, run.error)

    def retire() -> None:
        for k in reversed(range(len(live))):
            run = live[k]
            if run.error is None and not run.pruned and run.step < run.spec.total_steps:
                continue
            if run.error is None:
                try:
                    run.finish(array, k, run.step, seconds(run), device)
                except Exception as exc:  # e.g. its checkpoint directory is not writable
                    run.error = exc
            array.remove_member(k)
            live.pop(k)
            ended(run)

    def join() -> bool:
        """Refill the free slots from ``refill``; whether it offered anyone."""
        free = num_slots - len(live)
        if refill is None or free <= 0:
            return False
        joined: list[MemberRun] = []
        offered = refill(free, array.num_steps)
        for spec, callback in offered:
            run = MemberRun(len(runs), spec,
                            callback if callback is not None else TrainCallbacks())
            runs.append(run)
            try:
                _check(spec, int(spec.train_data.shape[1]), run.eval_data)
                array.join(spec, load_state(run))
            except Exception as exc:  # it cannot join (or its checkpoint is unreadable)
                run.error = exc
                ended(run)
                continue
            live.append(run)
            start(len(live) - 1)
            joined.append(run)
        evaluate_due(joined)
        return bool(offered)

    def settle() -> None:
        retire()
        while join():
            retire()

    for k in range(len(live)):
        start(k)
    evaluate_due(runs)
    settle()
    while live:
        step_start = time.perf_counter()
        out = array.step()
        step_seconds = time.perf_counter() - step_start
        for k, (run, step) in enumerate(zip(live, array.member_steps, strict=True)):
            run.step = step
            run.record_step(step, out.losses[k], out.lrs[k], out.epochs[k], step_seconds, device)
        evaluate_due(None)
        save_due()
        settle()
    results = [run.result for run in runs]
    if errors:
        raise FusedMemberError(results, errors)
    return [result for result in results if result is not None]


def _call_logits(
    template: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], ids_BT: Tensor
) -> Tensor:
    """``lm_logits`` of the template run with one member's (or the vmapped) tensors."""
    output = functional_call(template, (params, buffers), (ids_BT,), strict=True)
    logits_BTV = output if isinstance(output, Tensor) else getattr(output, "logits", None)
    if not isinstance(logits_BTV, Tensor):
        raise TypeError(f"model output {type(output).__name__} has no .logits tensor")
    return logits_BTV


def _eval_blocks(spec: TrainSpec) -> Tensor:
    if spec.eval_data is None:
        raise ValueError(f"job {spec.name!r} has no eval_data to evaluate on")
    if spec.eval_max_blocks is not None:
        return spec.eval_data[: spec.eval_max_blocks]
    return spec.eval_data
