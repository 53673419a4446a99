"""The torch side of chunked cross-entropy (``loss_chunks=N``, :mod:`.chunked_loss`): the LM head and
the loss over N chunks of a batch's target positions, imported only where a loss is computed.

The model's own forward still runs (so DDP's hooks, peft's adapters and accelerate's autocast wrap it
as they wrap the plain path); only its LM head is replaced for that one call by a function that
takes the head's input, the decoder's last hidden states, and reduces them chunk by chunk: each
chunk's logits made by the head's own forward, upcast to fp32 and reduced, under
``torch.utils.checkpoint`` (non-reentrant), so backward recomputes them one chunk at a time and the
whole rows x positions x vocabulary logits never exist at once. The head returns no logits (an empty
last dimension): a forward that changes the logits after its head is refused up front
(:func:`logits_are_the_heads`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # effitrain.train.tasks' (the train layer is above this one)
# Set on a model by the technique's apply (.chunked_loss): its chunks are recomputed in backward.
# Before it (the replay's count of model FLOPs) each chunk keeps what its backward needs instead.
RECOMPUTED = "_effitrain_loss_chunks_recomputed"


def chunked_loss_sum(model, inputs: dict, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """The summed next-token cross-entropy of a micro-batch over its real target tokens, as
    ``effitrain.train.tasks.shifted_cross_entropy(..., "sum")`` gives it, over ``chunks`` chunks of
    positions: the sum of the chunks' fp32 sums (the one difference: that summation order)."""
    recompute = bool(getattr(_unwrapped(model), RECOMPUTED, False))
    summed = functools.partial(_summed, labels=labels, chunks=chunks, recompute=recompute)
    with _head_replaced(model, summed) as out:
        model(**inputs)
    return out.value


def chunked_row_sums(model, inputs: dict, labels: torch.Tensor, chunks: int) -> torch.Tensor:
    """Each row's summed next-token cross-entropy (fp32), chunk by chunk, without gradients: the
    evaluation's figure, whose eval batch would otherwise hold its whole logits."""
    with _head_replaced(model, functools.partial(_row_sums, labels=labels, chunks=chunks)) as out:
        model(**inputs)
    return out.value


def target_chunks(hidden: torch.Tensor, labels: torch.Tensor, chunks: int) -> list:
    """(hidden states, their targets) of each chunk of the positions that have a target (all but the
    last): ``chunks`` near-equal runs of positions (``torch.tensor_split``), empty ones left out."""
    pairs = zip(
        torch.tensor_split(hidden[:, :-1], chunks, dim=1), torch.tensor_split(labels[:, 1:], chunks, dim=1)
    )
    return [(h, t) for h, t in pairs if h.shape[1]]


def _chunk_sum(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _summed(head, hidden, labels, chunks, recompute):
    from torch.utils.checkpoint import checkpoint

    from effitrain.util.compat import recomputation_tracked
    from effitrain.util.compat.pytorch import function_modes

    pairs = target_chunks(hidden, labels.to(hidden.device), chunks)
    # nothing is saved without gradients; before apply (a count of model FLOPs) nothing recomputes
    if not torch.is_grad_enabled() or not recompute:
        parts = [_chunk_sum(head, h, t) for h, t in pairs]
    else:
        # a step tracker counts what the recomputation allocates as recomputed activations
        run = recomputation_tracked(functools.partial(_chunk_sum, head))
        contexts = functools.partial(_contexts, function_modes())
        parts = [checkpoint(run, h, t, use_reentrant=False, context_fn=contexts) for h, t in pairs]
    if not parts:  # one position per row: no target, a zero that still reaches the graph
        return hidden[:, :0].float().sum()
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _row_sums(head, hidden, labels, chunks):
    rows = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for h, t in target_chunks(hidden, labels.to(hidden.device), chunks):
        per_token = F.cross_entropy(
            head(h).flatten(0, 1).float(), t.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        rows = rows + per_token.view(len(t), -1).sum(dim=1)
    return rows


def _contexts(modes: list):
    """Checkpoint's (forward, recomputation) contexts: the forward runs where it is called (inside
    the model's forward, under its autocast); the recomputation in backward re-enters the
    torch-function modes the forward ran under (the CUDA replay's emulated autocast: a mode, not
    torch's autocast state, which checkpoint restores itself)."""
    return contextlib.nullcontext(), _entered(modes)


@contextlib.contextmanager
def _entered(modes: list):
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


class _Out:
    value = None


def _unwrapped(model):
    """The model inside DDP's and torch.compile's wrappers (peft's forward attributes to its base)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@contextlib.contextmanager
def _head_replaced(model, compute):
    """Within, the model's LM head (its output embeddings, as peft may have wrapped them) returns no
    logits: ``compute(head's own forward, its input)`` is kept in the yielded object's ``value``."""
    head = _unwrapped(model).get_output_embeddings()
    if head is None:
        raise RuntimeError(
            f"{type(_unwrapped(model)).__name__} has no output embeddings: loss_chunks needs its LM head"
        )
    own = head.__dict__.get("forward")  # a forward already set on the instance (a library's hook) is kept
    original = head.forward
    out = _Out()

    def forward(hidden, *args, **kwargs):
        out.value = compute(original, hidden)
        return hidden.new_empty((*hidden.shape[:-1], 0))  # no logits: the loss is out.value

    head.forward = forward
    try:
        yield out
    finally:
        if own is not None:
            head.forward = own
        else:
            del head.forward
    if out.value is None:
        raise RuntimeError(f"{type(_unwrapped(model)).__name__}'s forward never called its LM head")


def logits_are_the_heads(config, trust_remote_code: bool = False) -> bool | None:
    """Whether a causal LM built from ``config``'s miniature returns as its logits exactly what its LM
    head made of the hidden states, called once on all positions: what chunking the head's input
    assumes. False for a forward that changes them after the head (Gemma 2's
    ``final_logit_softcapping``, Cohere's ``logit_scale``) or never calls it; None when the
    miniature cannot be built. The head's weights are scaled up so that a soft cap bends them."""
    key = (config.to_json_string(), trust_remote_code)
    if key not in _VERDICTS:  # plan asks once per chunk count
        _VERDICTS[key] = _logits_are_the_heads(config, trust_remote_code)
    return _VERDICTS[key]


_VERDICTS: dict = {}


def _logits_are_the_heads(config, trust_remote_code: bool) -> bool | None:
    from effitrain.config.causality import miniature_decoder

    model = miniature_decoder(config, trust_remote_code)
    if model is None:
        return None
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        return False
    seen = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append((args[0].shape, output)))
    ids = torch.randint(int(model.config.vocab_size), (2, 6), generator=torch.Generator().manual_seed(0))
    model.eval()
    try:
        with torch.no_grad():
            head.weight.mul_(100)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        handle.remove()
    return (
        len(seen) == 1
        and tuple(seen[0][0][:2]) == (2, 6)
        and seen[0][1].shape == logits.shape
        and torch.equal(seen[0][1].float(), logits.float())
    )
