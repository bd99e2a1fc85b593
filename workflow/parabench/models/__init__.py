"""Models: the presets and the user's own, behind two calls.

- `facts(spec)`: what planning must know (blocks, tensor-parallel widths, size
  problems). Torch-free for the presets (facts.py), so the Snakefile plans without
  importing torch; a custom model is loaded from the user's file, built on fake tensors
  and checked once (custom.py); a transformers model is read from its config (hf.py).
  No model is built for real here: planning runs on a login node.
- `build(spec, seed)`: the model itself, a `base.Model` (needs torch).

Every model is a module plus a loss and a batch generator, and the names of its
repeated blocks (base.py holds that contract); pipeline stages are cut between the
blocks (stages.py). Custom models (custom.py) and transformers models (hf.py) keep the
module their author wrote. Presets: `mlp` (the seed MLP), `seqnet` (the DDP
tutorial's net), `resmlp` (uniform pre-norm residual MLP blocks) and `gpt` (a
decoder-only transformer in nanoGPT's shape), in presets.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parabench.models.facts import DEFAULTS, PRESETS, ModelFacts, preset_facts

if TYPE_CHECKING:
    from parabench.models.base import Model
    from parabench.spec import ModelSpec

__all__ = ["DEFAULTS", "PRESETS", "ModelFacts", "build", "facts"]


def facts(spec: ModelSpec) -> ModelFacts:
    """What planning needs to know of the model, and what is wrong with its sizes."""
    if spec.arch == "custom":
        from parabench.models.custom import inspect_factory

        return inspect_factory(spec)
    if spec.arch == "hf":
        from parabench.models import hf

        return hf.facts(spec)
    return preset_facts(spec.arch, spec.size_dict())


def build(spec: ModelSpec, seed: int) -> Model:
    """The model on CPU with weights drawn from `seed`, so every rank and every
    strategy starts from identical parameters."""
    import torch

    torch.manual_seed(seed)
    if spec.arch == "custom":
        from parabench.models.custom import build_custom

        return build_custom(spec)
    if spec.arch == "hf":
        from parabench.models import hf

        return hf.build(spec)
    from parabench.models.presets import PRESET_BUILDERS

    return PRESET_BUILDERS[spec.arch](spec.size_dict())
