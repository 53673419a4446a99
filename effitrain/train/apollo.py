"""APOLLO (apollo-torch's AdamW) on effitrain's decay / no-decay parameter groups.

APOLLO keeps AdamW's two moments only for a random rank-``rank`` projection of a weight matrix's
gradient and uses them to scale the raw gradient per channel (or per tensor): state shrinks from
2 x m x n to 2 x max(m, n) x rank, plus the rank x min(m, n) projection. Its optimizer wants the
matrices in groups of their own that carry the projection's settings; this class makes those
groups from the groups it is given, so the optimizer config stays one YAML file
(``conf/optimizer/apollo.yaml``).
"""

from __future__ import annotations

import torch
from apollo_torch import APOLLOAdamW as _APOLLOAdamW
from apollo_torch.random_projector import GradientProjector
from apollo_torch.svd_projector import GaLoreProjector

from effitrain.util.compat import apollo_projector, apollo_projector_state

PROJECTORS = {cls.__name__: cls for cls in (GradientProjector, GaLoreProjector)}


def low_rank(param: torch.Tensor, rank: int) -> bool:
    """A matrix whose both sides exceed ``rank`` gets a projection; the rest plain AdamW moments."""
    return param.ndim == 2 and min(param.shape) > rank


class APOLLOAdamW(_APOLLOAdamW):
    """apollo_torch's APOLLO AdamW; each given group's weight matrices (``low_rank``) move to a
    twin group with the projection settings, the group's other keys (weight decay) kept.

    effitrain's groups carry no parameter names, so the embedding matrices are projected as well
    (the paper projects attention and MLP weights only). Empty groups are left out.

    A checkpoint holds each projector as a plain dict of its attributes (a tensor and numbers), so
    it loads with ``torch.load(weights_only=True)``; loading makes the projector again.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        rank: int = 32,
        scale: float = 1.0,
        scale_type: str = "channel",
        proj: str = "random",
        proj_type: str = "std",
        update_proj_gap: int = 200,
        scale_front: bool = False,
        disable_nl: bool = False,
    ):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if scale_type not in ("channel", "tensor"):
            raise ValueError(f"scale_type must be channel or tensor, got {scale_type!r}")
        if proj != "random":  # svd (GaLore's projector): its state is not modeled by effitrain's estimate
            raise ValueError(f"proj must be random, got {proj!r}")
        if proj_type not in ("std", "reverse_std", "right", "left"):
            raise ValueError(f"proj_type must be std, reverse_std, right or left, got {proj_type!r}")
        if scale_type == "channel" and proj_type != "std":
            # apollo-torch scales channels along the side std projects: the other sides' shapes fail
            raise ValueError(
                f"proj_type {proj_type!r} needs scale_type tensor (channel scaling works with std only)"
            )
        if isinstance(update_proj_gap, bool) or not isinstance(update_proj_gap, int) or update_proj_gap < 1:
            raise ValueError(f"update_proj_gap must be an integer >= 1, got {update_proj_gap!r}")
        projection = {"rank": rank, "scale": scale, "scale_type": scale_type, "proj": proj,
                      "proj_type": proj_type, "update_proj_gap": update_proj_gap}  # fmt: skip
        params = list(params)
        if params and not isinstance(params[0], dict):
            params = [{"params": params}]
        groups = []
        for group in params:
            tensors = list(group["params"])
            plain = [p for p in tensors if not low_rank(p, rank)]
            matrices = [p for p in tensors if low_rank(p, rank)]
            groups += [{**group, "params": plain}] if plain else []
            groups += [{**group, "params": matrices, **projection}] if matrices else []
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         scale_front=scale_front, disable_nl=disable_nl)  # fmt: skip

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["state"] = {  # copies: the packed state shares its dicts with the live one
            index: {
                **state,
                "projector": apollo_projector_state(state["projector"]),
            }
            if "projector" in state
            else state
            for index, state in saved["state"].items()
        }
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loading casts nested containers (and mangles the strings in them): the projectors
        # are taken out first and made again for the parameters they belong to (state is indexed in
        # the order of param_groups)
        states = {index: dict(state) for index, state in state_dict["state"].items()}
        saved = {index: state.pop("projector") for index, state in states.items() if "projector" in state}
        super().load_state_dict({**state_dict, "state": states})
        params = [param for group in self.param_groups for param in group["params"]]
        for index, attributes in saved.items():
            projector = apollo_projector(attributes, PROJECTORS)
            if torch.is_tensor(projector.ortho_matrix):
                projector.ortho_matrix = projector.ortho_matrix.to(params[index].device)
            self.state[params[index]]["projector"] = projector
