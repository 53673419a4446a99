"""Chunked cross-entropy (``loss_chunks=N``): a causal LM's head and loss over N chunks of each
batch's target positions, each chunk's logits made, upcast to fp32 and reduced one at a time and
recomputed in backward, so the rows x positions x vocabulary logits (and their fp32 copy and
gradient) never exist at once, as torchtune's ``CEWithChunkedOutputLoss`` and Liger's fused linear
cross-entropy save them. For a large vocabulary and a small model they are the step's largest
tensors; the price is the head's forward matmul run twice. The loss is the same sum over the same real
target tokens, normalized as before; only the order its fp32 per-chunk sums are added in differs.

    python train.py task=causal_lm loss_chunks=8

Evaluation chunks too (without gradients, so without recomputation): an eval batch's logits would
otherwise be the run's peak, often above the step's (eval_batch_size rows, no lever to pull).
The torch code is :mod:`.chunked_head`, imported where a loss is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from effitrain.config.errors import invalid
from effitrain.config.parallel import shards

ALLOWED = "must be an integer >= 1 (1: the whole logits at once; N: the LM head and loss over N chunks)"


@dataclass(frozen=True)
class ChunkedLoss:
    """The technique (:class:`effitrain.config.techniques.Technique`) of ``loss_chunks``."""

    key: str = "loss_chunks"

    def chunks(self, cfg: DictConfig) -> int:
        """The chunks ``cfg`` asks for: 1, the plain loss, when the key is absent."""
        value = cfg.get(self.key)
        return 1 if value is None else int(value)

    def check(self, cfg: DictConfig) -> None:
        """An integer >= 1; above 1, only for task=causal_lm, at most the target positions of a
        row (max_length - 1), on the eager, unsharded path it is built for, and for a model whose
        logits are its LM head's output (checked on a miniature of its config).

        Raises:
            ConfigError: one line naming the value and what is allowed.
        """
        value = cfg.get(self.key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(self.key, value, ALLOWED)
        refusal = self.refusal(cfg, value) if value > 1 else None
        if refusal:
            raise invalid(self.key, value, refusal)

    def refusal(self, cfg: DictConfig, value: int) -> str | None:
        """Why ``cfg`` cannot split its loss into ``value`` (> 1) chunks; None when it can."""
        from effitrain.config.model_spec import task_class

        task = getattr(task_class(cfg), "name", None)
        if task != "causal_lm":
            return f"chunks split a causal LM's logits over positions: with task={task} give 1"
        positions = int(cfg.max_length) - 1
        if value > positions:
            return f"at most the {positions} target positions of a max_length={cfg.max_length} row (max_length - 1)"
        if cfg.compile.get("enabled"):
            return "the chunked head is not built for torch.compile: give 1, or compile=off"
        if shards(cfg):
            return "the chunked head is not built for FSDP sharding: give 1, or parallel=ddp"
        return self.model_refusal(cfg)

    def model_refusal(self, cfg: DictConfig) -> str | None:
        """The model's logits are exactly its LM head's output (:func:`.chunked_head.logits_are_the_heads`),
        from its config alone where it is known before loading (else :meth:`apply` checks the built one)."""
        from effitrain.config.model_spec import model_architecture

        architecture = model_architecture(cfg.model)
        model_type = architecture.pop("model_type", None)
        if not model_type:
            return None
        from transformers import AutoConfig

        try:
            config = AutoConfig.for_model(model_type, **architecture)
        except Exception:  # noqa: BLE001 - the build reports a config it cannot make
            return None
        return _other_logits(config, bool(cfg.model.get("trust_remote_code")))

    def apply(self, model, cfg: DictConfig, autocast=None) -> None:
        """From now on the model's loss chunks are recomputed in backward (the loss replaces its head
        per call, :mod:`.chunked_head`; before this, as in the replay's count of model FLOPs, each
        chunk keeps what its backward needs). The built model's config is checked where it was not
        up front (a hub id without a local config). ``autocast`` needs nothing: each chunk's
        recomputation re-enters the modes its forward ran under.

        Raises:
            ConfigError: a built model whose forward changes its head's output.
        """
        value = self.chunks(cfg)
        if value == 1:
            return
        from effitrain.config.model_spec import model_architecture
        from effitrain.config.techniques.chunked_head import RECOMPUTED
        from effitrain.util.compat.pytorch import on_fake_or_meta

        parameter = next(model.parameters(), None)
        known = model_architecture(cfg.model).get("model_type")
        if not known and parameter is not None and not on_fake_or_meta(parameter):
            refusal = _other_logits(model.config, bool(cfg.model.get("trust_remote_code")))
            if refusal:
                raise invalid(self.key, value, refusal)
        setattr(model, RECOMPUTED, True)

    def replay_key(self, cfg: DictConfig) -> dict:
        return {self.key: self.chunks(cfg)}

    def plan_values(self, cfg: DictConfig, given: bool, asked=None, device: str = "cpu") -> list:
        """1 (off) first, then the asked chunk counts (8 unless asked: torchtune's default) this run
        can take (at most a row's target positions); the user's own alone when given; [1] for a task
        other than causal_lm, or a model or setting the chunked head is not built for."""
        if given:
            return [self.chunks(cfg)]
        values = sorted({int(v) for v in (asked if asked is not None else (1, 8)) if int(v) > 1})
        if not values or self.refusal(cfg, values[0]):
            return [1]
        return [1, *(v for v in values if not self.refusal(cfg, v))]

    def recomputes(self, cfg: DictConfig) -> bool:
        """Each chunk's head runs again in backward."""
        return self.chunks(cfg) > 1

    def override(self, value) -> str:
        return f"{self.key}={int(value)}"

    def described(self, cfg: DictConfig) -> str:
        return self.override(self.chunks(cfg))


# Settings by which a causal LM's forward changes its head's output (their neutral value): Gemma 2's
# soft cap, Cohere's and Granite's scales. Named where the miniature cannot be built.
LOGIT_CHANGERS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def _other_logits(config, trust_remote_code: bool) -> str | None:
    """Why the chunked head cannot stand in for ``config``'s LM head, or None: a setting of
    :data:`LOGIT_CHANGERS` away from its neutral value, or a miniature whose logits are not its
    head's output (:func:`.chunked_head.logits_are_the_heads`)."""
    from effitrain.config.techniques.chunked_head import logits_are_the_heads

    kind = type(config).__name__.removesuffix("Config")
    for name, neutral in LOGIT_CHANGERS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            return (f"{kind}'s forward changes its LM head's output before returning logits ({name}={value}), "
                    "which chunks would skip: give 1")  # fmt: skip
    if logits_are_the_heads(config, trust_remote_code) is False:
        return (f"{kind}'s forward changes its LM head's output before returning logits, which chunks "
                "would skip: give 1")  # fmt: skip
    return None


LOSS_CHUNKS = ChunkedLoss()
