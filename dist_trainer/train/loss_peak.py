"""The loss's peak working set, measured in a run: the plan check's ``loss_working_set`` figure.

The head's projection and the loss hold their largest tensors for a moment: the logits, the fp32 log-softmax and,
in the backward, their gradients (whole, or one chunk's with ``model.loss_chunk_tokens``, beside the head weight's
and input's gradients). No saved-tensor hook sees the backward's, and CUDA's peak mixes them with everything else,
so ``LossPeak`` measures them apart. It keeps the check step's first micro-batch's head input and loss arguments on
the rank that holds the head and, after the step (its activations freed, so the replay adds nothing to the step's
peak), runs the head's projection and the loss again on them with the same weights (the run's modules and
collectives: TP's vocabulary-parallel loss, ZeRO-3's head weight gathered, the step's autocast) and takes the
gradients with ``torch.autograd.grad``, which leaves ``.grad`` and the regimes' gradient hooks alone. A dispatch
mode counts the storages every op of that replay creates (an output sharing an input's storage, a view or an
in-place op, is not new) and a ``weakref.finalize`` on each returns its bytes when it is freed: the peak is what
``planner/loss_costs.loss_peak`` prices (and ``tests/planner_measure.loss_peak_bytes`` measures through the
resident set in a process of its own). The replay's saved tensors go to no saved-tensor hook of the step's. A
pipeline's schedule keeps the last stage's output (``loss_costs.pipeline_logits``) outside this figure.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from dist_trainer.model import Transformer


class _NewStorages(TorchDispatchMode):
    """Hands every storage an op creates to ``peak.allocated`` while ``peak.counting``."""

    def __init__(self, peak: LossPeak) -> None:
        super().__init__()
        self.peak = peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.peak.counting:
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.peak.allocated(t.untyped_storage(), inputs)
        return out


class LossPeak:
    """The peak bytes the head's projection and the loss allocate for one micro-batch (module docstring): the hooks
    keep the first micro-batch's head input and loss arguments; ``replay`` measures after the step
    (``PlanCheck.after_backward``, with its collectives kept out of the step's counts); ``peak`` is None until then."""

    def __init__(self, autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.autocast = autocast  # the step's autocast (engines/base.autocast_for)
        self.live = 0
        self.most = 0
        self.sizes: dict[int, int] = {}
        self.counting = False
        self.peak: int | None = None
        self.head_in: torch.Tensor | None = None
        self.call: tuple[Transformer, torch.nn.Module, tuple] | None = None
        self.handles: list[RemovableHandle] = []

    def attach(self, model: Transformer) -> None:
        self.handles += [model.head_input.register_forward_hook(self._head_input),
                         model.loss.register_forward_hook(partial(self._loss, model))]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def allocated(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in inputs or key in self.sizes:
            return
        self.sizes[key] = n
        self.live += n
        self.most = max(self.most, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def _head_input(self, module: torch.nn.Module, args: object, out: object) -> None:
        if self.head_in is None and isinstance(out, torch.Tensor) and out.requires_grad:
            self.head_in = out.detach()  # its storage, not the step's graph

    def _loss(self, model: Transformer, module: torch.nn.Module, args: tuple, out: object) -> None:
        if self.head_in is not None and self.call is None:
            self.call = (model, module, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[1:]))

    def replay(self) -> None:
        """After the step (its activations freed): the head's projection and the loss again on the kept input, the
        gradients taken with ``torch.autograd.grad``, every storage they create counted. Collective where the step
        was (TP's loss, ZeRO-3's gather of the head's weight): every rank of the step calls it."""
        if self.call is None or self.head_in is None:
            return
        (model, module, rest), head_in = self.call, self.head_in.requires_grad_()
        self.call = self.head_in = None
        params = [w for w in (model.output_weight(), model.output_bias) if w is not None]
        with _gathered(params), _head_aliases(model) as weights, self.autocast(), \
                torch.autograd.graph.saved_tensors_hooks(_same, _same):
            self.counting = True
            try:
                with _NewStorages(self):
                    # forward, not __call__: the module's hooks (these, a user's) saw the step already
                    loss = module.forward(head_in if model.cfg.loss_chunk_tokens else model.project(head_in), *rest)
                    grads = torch.autograd.grad(loss, [head_in, *weights], allow_unused=True)
                    del loss, grads
            finally:
                self.counting = False
        self.peak = self.most


@contextlib.contextmanager
def _head_aliases(model: Transformer) -> Iterator[list[torch.Tensor]]:
    """The head's weight and bias, for the replay, as new leaves over the same storage (no copy): their gradients
    reach no hook that a regime, the health monitor or a user put on the parameters. Yields those that train (a
    frozen head, under LoRA or train.freeze, has no gradient)."""
    weight, bias = model.output_weight(), model.output_bias
    alias = weight.detach().requires_grad_(weight.requires_grad)
    bias_alias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=bias.requires_grad)
    model.output_weight = lambda: alias  # type: ignore[method-assign]  # an instance attribute, removed below
    if bias is not None:
        model._parameters["output_bias"] = bias_alias
    try:
        yield [t for t in (alias, bias_alias) if t is not None and t.requires_grad]
    finally:
        del model.output_weight
        if bias is not None:
            model._parameters["output_bias"] = bias


def _gathered(params: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """DeepSpeed ZeRO-3's partitioned parameters gathered whole for the replay (collective over their group)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
