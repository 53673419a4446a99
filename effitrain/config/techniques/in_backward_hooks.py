"""The hooks of the optimizer step in backward (:mod:`effitrain.config.techniques.in_backward`, which
says why): imported only where the technique is on, as this module imports torch."""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge


class InBackward:
    """``optimizer``'s update of each of its parameters run by that parameter's gradient accumulator,
    after every other hook on the gradient; the gradient freed right after.

    ``model``: the module whose parameters it steps (their order is the norm's); ``optimizer``: the
    torch optimizer the run keeps (the one accelerate wraps, the scheduler steps,
    checkpoints save); its ``step`` is looked up at each call, so a wrapper put on it later (the
    scheduler's step counter, the replay's assumed values) runs too.
    """

    def __init__(self, model, optimizer):
        self.optimizer = optimizer
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        # in the model's order, the order clip_grad_norm_(model.parameters()) stacks their norms in
        self.params = [p for p in model.parameters() if id(p) in stepped]
        if len(self.params) != len(stepped):
            raise ValueError("optimizer_in_backward: the optimizer steps parameters the model does not hold")
        self._norms: list = [None] * len(self.params)  # each gradient's 2-norm, in parameter order
        # autograd holds a parameter's AccumulateGrad node weakly: a hook on it lives as long as this
        self._nodes = [get_gradient_edge(p).node for p in self.params]
        self._handles = [node.register_hook(self._updates(i)) for i, node in enumerate(self._nodes)]

    def _updates(self, index: int):
        param = self.params[index]

        def update(*_):  # a node post hook: (grad_inputs, grad_outputs), neither read
            if param.grad is None:
                return
            # the norm clip_grad_norm_ takes of each gradient (its foreach form, CPU and CUDA alike)
            self._norms[index] = torch._foreach_norm([param.grad], 2.0)[0]
            self.optimizer.step()  # every other parameter's gradient is None: this one alone moves
            param.grad = None

        return update

    def norm(self) -> torch.Tensor:
        """The 2-norm of the gradients of the backward just run, as ``clip_grad_norm_`` combines its
        per-tensor norms (stacked in parameter order); 0 where none was made. Forgets them."""
        norms = [n for n in self._norms if n is not None]
        self._norms = [None] * len(self.params)
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def remove(self) -> None:
        """The hooks removed: the optimizer steps after backward again."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._nodes = [], []
