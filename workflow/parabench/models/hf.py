"""A Hugging Face transformers model as people train it: `arch: hf`.

    models:
      llama:
        arch: hf
        model_type: llama                 # any model type AutoConfig knows
        config: {hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4,
                 num_key_value_heads: 2, intermediate_size: 512, vocab_size: 1024}
        seq_len: 128
        batch_size: 16

The model is built from its config (`AutoConfig.for_model`, `from_config`): no weights,
no network; its weights are drawn from the cell's seed, so every strategy starts alike.
It runs unchanged: its own forward, its own loss (`loss_function`, the next-token
cross-entropy: the labels are the input ids, shifted inside), its own blocks (the
classes in `_no_split_modules`, FSDP's units), its own tensor-parallel plan
(`base_model_tp_plan`, its column- and row-wise layers). The batch is token ids drawn
from the config's vocabulary. parabench calls it through `CausalLM`, which asks for
the logits only (no cache).

Planning reads the config alone (`facts`): a 70B config is checked without building
it. transformers is an optional extra (`pip install .[hf]`), imported only here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from parabench.models.facts import SEQUENCE, ModelFacts, TPSplit

if TYPE_CHECKING:
    import torch
    from torch import nn

    from parabench.models.base import Model
    from parabench.spec import ModelSpec

INSTALL = "arch hf needs transformers: pip install '.[hf]' (or pip install transformers)"
# The styles of a transformers plan that are parabench's own (strategies/tp.py);
# the others (embedding, gathered head) keep those layers whole on every rank.
STYLES = ("colwise", "rowwise")


class HFError(ValueError):
    """The config cannot give a transformers model."""


def _config(spec: ModelSpec):
    sizes = spec.size_dict()
    try:
        from transformers import AutoConfig
    except ImportError:
        raise HFError(INSTALL) from None
    overrides = sizes.get("config") or {}
    try:
        config = AutoConfig.for_model(sizes["model_type"], **overrides)
    except Exception as e:  # unknown type, or the config's own validation
        raise HFError(f"model_type {sizes['model_type']!r}: {type(e).__name__}: {e}") from None
    known = set(type(config)().to_dict()) | set(getattr(config, "attribute_map", {}))
    if unknown := sorted(set(overrides) - known):
        raise HFError(
            f"model_type {sizes['model_type']!r} has no config keys {unknown} "
            f"(a typo would give a default-size model)"
        )
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise HFError(f"model_type {sizes['model_type']!r} has no causal language model")
    config.use_cache = False  # training: no key/value cache in the outputs
    return config


def _layers(config) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))


def _plan_widths(config) -> tuple[int, ...]:
    """What the config's plan splits over the ranks: attention heads, key/value heads
    and the MLP's width."""
    names = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    return tuple(dict.fromkeys(int(v) for n in names if (v := getattr(config, n, None))))


@functools.cache
def facts(spec: ModelSpec) -> ModelFacts:
    """What planning needs, from the config alone."""
    try:
        config = _config(spec)
    except HFError as e:
        key = "arch" if str(e) == INSTALL else "model_type"
        return ModelFacts(0, False, problems=(f"{key}: {e}",))
    plan = dict(config.base_model_tp_plan or {})
    what = "attention heads, key/value heads and MLP width"
    split = TPSplit("config", what, _plan_widths(config))
    sequence = TPSplit("seq_len", SEQUENCE, (int(spec.size_dict()["seq_len"]),))
    why = None
    if other := sorted({v for v in plan.values() if v not in STYLES}):
        # Dropping them would leave layers whose gradients TP must all-reduce (q/k
        # norms) or whose partner is split: wrong maths, or a shape error.
        why = (
            f"transformers' {config.model_type} plan uses styles parabench does not apply "
            f"({', '.join(other)}; it applies {' and '.join(STYLES)})"
        )
    elif not plan:
        why = (
            f"transformers' {config.model_type} declares no tensor-parallel plan of "
            "column- and row-wise nn.Linear layers (base_model_tp_plan)"
        )
        if config.model_type == "gpt2":
            why += "; its projections are Conv1D, whose weight is transposed"
    # What a stage cut cannot take, known from the config; the rest is checked when a
    # stage is built (stages.trace), which planning does not do: no model is built here.
    cut = None
    if config.tie_word_embeddings:
        cut = (
            f"transformers' {config.model_type} ties its head to its input embeddings "
            "(tie_word_embeddings): the first and last stages would each train their own "
            "copy (config: {tie_word_embeddings: false} unties them)"
        )
    elif getattr(config, "layerdrop", 0):
        cut = (
            f"layerdrop {config.layerdrop}: training drops layers at random, and a stage "
            "whose first or last layer is dropped has nothing to receive or send"
        )
    return ModelFacts(
        _layers(config),
        bool(plan),
        (split, sequence) if plan else (),
        cut_skip=cut,
        tp_skip=why,
    )


def _causal_lm():
    from torch import nn

    class CausalLM(nn.Module):
        """The model, asked for its logits only; its parameters are under `hf.`."""

        def __init__(self, hf: nn.Module) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            with _masks_as_on_real(input_ids):
                return self.hf(input_ids=input_ids, use_cache=False).logits

    return CausalLM


@contextlib.contextmanager
def _masks_as_on_real(input_ids: torch.Tensor) -> Iterator[None]:
    """On fake tensors (advise, the rehearsal), transformers' causal mask as a real step
    makes it: none, left to SDPA's is_causal. transformers reads the position ids to
    find sequences packed into one row; on fake tensors it cannot read them, takes the
    batch for packed, and builds a (batch, 1, seq, seq) mask and its grad path that no
    GPU run holds (a 4-rank llama's fake peak was 11% over the real one). parabench's
    batches are never packed: one sequence per row."""
    from torch._subclasses.fake_tensor import is_fake
    from transformers import masking_utils

    if not is_fake(input_ids):
        yield
        return
    find = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def build(spec: ModelSpec) -> Model:
    """The model from its config, weights from torch's seeded generator (the caller
    seeded it)."""
    import torch

    from parabench.models.base import Model
    from parabench.models.custom import find_blocks

    config = _config(spec)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(config)
    hf.train()
    module = _causal_lm()(hf)
    sizes = spec.size_dict()
    vocab, seq_len = int(config.vocab_size), int(sizes["seq_len"])
    if sizes.get("blocks"):
        names = find_blocks(module, f"hf.{sizes['blocks']}")
    else:
        kinds = set(getattr(hf, "_no_split_modules", None) or ())
        names = tuple(n for n, m in module.named_modules() if type(m).__name__ in kinds)
        names = names or find_blocks(module)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return hf.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq_len), generator=generator)
        return ids, ids  # the model shifts the labels: each token predicts the next

    def for_counting(copy: nn.Module) -> nn.Module:
        """A copy of the model with eager attention: torch's FLOP counter has no
        formula for sdpa's CPU kernel, so its attention would count as free."""
        copy.hf.set_attn_implementation("eager")
        return copy

    plan = tp_plan(module, config)
    return Model(
        module,
        loss,
        batch,
        plan,
        sp_plan=sp_plan(module, names, plan),
        device_batches=False,
        tokens_per_sample=seq_len,
        block_names=names,
        for_counting=for_counting,
    )


def tp_plan(module: nn.Module, config) -> dict[str, str]:
    """The config's plan (names relative to the base model, `*` for each block) as
    parabench's: every matching module's full name -> colwise | rowwise."""
    import fnmatch

    base = f"hf.{module.hf.base_model_prefix}."
    plan = {k: v for k, v in (config.base_model_tp_plan or {}).items() if v in STYLES}
    out = {}
    for pattern, style in plan.items():
        found = [
            name
            for name, _ in module.named_modules()
            if name.startswith(base) and fnmatch.fnmatchcase(name.removeprefix(base), pattern)
        ]
        if not found:  # a plan that splits less than it says would run replicated
            raise HFError(f"the tensor-parallel plan's {pattern!r} names no module under {base}")
        out.update(dict.fromkeys(found, style))
    return out


def sp_plan(module: nn.Module, blocks: tuple[str, ...], plan: dict[str, str]) -> dict[str, str]:
    """Sequence parallelism for a decoder shaped as Llama and its kin (strategies/tp.py):
    the input embedding, each block's two norms and the final one, each block's planned
    attention and MLP, the head. The hidden states stay DTensors (`_dtensor` styles):
    the model's own code reads positions and masks off their length. Empty where the
    model is not so shaped (its TP then keeps the sequence whole, and says so)."""
    from torch import nn

    hf = module.hf
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    names = {m: n for n, m in module.named_modules()}
    base = names[hf.base_model]
    final = [n for n, m in hf.base_model.named_children() if type(m).__name__.endswith("Norm")]
    if not (isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear) and len(final) == 1):
        return {}
    sp = {names[embed]: "embed_to_sequence_dtensor", f"{base}.{final[0]}": "sequence"}
    sp[names[head]] = "colwise_from_sequence"
    for block in blocks:
        children = dict(module.get_submodule(block).named_children())
        norms = [n for n, m in children.items() if type(m).__name__.endswith("Norm")]
        inner = {n for n in children if any(k.startswith(f"{block}.{n}.") for k in plan)}
        if len(norms) != 2 or len(inner) != 2:
            return {}
        sp.update({f"{block}.{n}": "sequence" for n in norms})
        sp.update({f"{block}.{n}": "gather" for n in inner})
    sp.update({k: "rowwise_to_sequence_dtensor" for k, v in plan.items() if v == "rowwise"})
    return sp


def preload(spec: ModelSpec) -> None:
    """Import what building the model will (a torchrun agent does, before forking)."""
    try:
        config = _config(spec)  # imports transformers (or says it is missing)
    except HFError:
        return  # the ranks will say why
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(config)]  # imports the model's own module


def preload_types(model_types: list[str]) -> None:
    """Import transformers and these model types' modules, as `preload` does for one
    model (a run's warm process does, once for the launches it forks: 3 to 7 s each on
    two cores). Raises what transformers raises: missing, or a type it lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for model_type in model_types:
        AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))]
