"""Pipeline stages: split the one model into pp_size (x virtual) stages, build only this rank's.

Layout (Megatron / torchtitan): the first stage owns the embeddings, the last the final
norm and the head (with BERT's MLM transform and output bias); the layer stack is cut into
contiguous runs, balanced by layer count or by parameter count, or given explicitly
(``stage_layers``). With ``virtual_stages`` v > 1 there are pp_size * v stages; rank r owns
stages r, r + pp_size, ... ("loop" placement, Narayanan et al. 2021, section 2.2, the
interleaved schedule) or, for the zero-bubble V schedule, r and 2 * pp_size - 1 - r ("v"
placement, Qi et al. 2024, ZB-V).

Exact weights without the whole model: ``Transformer.reset_parameters`` draws every weight
in module order from the global RNG. A rank builds the full model on the meta device (no
memory), materialises only the modules it keeps, and replays the same draw sequence: a
kept module draws into its own tensor, any other module draws into a scratch tensor of the
same shape (one at a time) only to advance the generator. So every stage's weights equal
the matching slice of ``build_model(cfg, seed=seed)`` bit for bit, and at most one
non-owned tensor is ever allocated. (The replay costs O(total parameters) RNG time per rank;
a per-module seed in model.py would remove it.)

Tied embeddings: the last stage keeps its own copy of ``tok_emb`` as its head weight. Both
copies start equal (same draw); after backward ``PipelineSchedule.finalize_grads`` sums the
two gradients between the first and last stage, as Megatron's embedding group does
(megatron/core/distributed/finalize_model_grads.py, ``_allreduce_word_embedding_grads``), so
both copies take the same optimizer step and the loss equals the single model's.

An encoder-decoder (issue 24; ``layout_rules/seq2seq.py``): encoder stages first, decoder stages after, each holding
layers of one stack; the first stage also holds the decoder's position tables (it embeds both stacks' inputs), the last
encoder stage ``enc_norm``; ``parallel/pipeline/seq2seq.py`` runs them.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_names import (
    DECODER_FIRST_MODULES,
    ENCODER_LAST_MODULES,
    FIRST_STAGE_MODULES,
    LAST_STAGE_MODULES,
    LAST_STAGE_PARAMETERS,
)
from dist_trainer.layout_rules import layers_per_stage
from dist_trainer.layout_rules.seq2seq import encoder_stage_count
from dist_trainer.model import Transformer
from dist_trainer.model_blocks import init_weights_
from dist_trainer.model_moe import attach_aux_losses, moe_layers
from dist_trainer.parallel.pipeline.seq2seq import seq2seq_stage_forward

PLACEMENTS = ("loop", "v")


class StageModule(nn.Module):
    """One pipeline stage: a trimmed ``Transformer`` holding only this stage's modules.

    forward: (B, T) tokens on the first stage, else (B, T, C) hidden state -> (B, T, C)
    hidden state, or (B, T, V) logits on the last stage; with a packed batch's (B, T) segment ids after them
    (``documents``), which every stage but the last sends on beside its hidden state (no gradient: int64).
    ``model.layers[i]`` is global layer
    ``first_layer + i`` (activation checkpointing and checkpoints use global indices). An encoder-decoder's stage
    (``encoder_stages``: how many stages the encoder has) runs ``seq2seq.seq2seq_stage_forward`` (its tuples).
    """

    def __init__(self, model: Transformer, stage_index: int, num_stages: int, first_layer: int,
                 encoder_stages: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.first_layer = first_layer
        self.encoder_stages = encoder_stages

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def layer_ids(self) -> range:
        """Global indices of the stage's layers (an encoder-decoder's decoder layers after the encoder's)."""
        return range(self.first_layer, self.first_layer + len(self.model.layers) + len(self.model.dec_layers or ()))

    def set_activation_checkpointing(self, mode: str, every: int = 1) -> None:
        """As ``Transformer.set_activation_checkpointing``, on global layer indices (``run_layers`` looks layers
        up by ``first_layer + i``, so every_k checkpoints the same layers as in the single model)."""
        self.model.set_activation_checkpointing(mode, every, self.first_layer)

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.encoder_stages is not None:
            out = seq2seq_stage_forward(self, *args)
            return attach_aux_losses(self.model, out) if self.training and not isinstance(out, tuple) else out
        x, *documents = args  # packed sequences: their segment ids travel with the micro-batch, stage to stage
        docs = documents[0] if documents else None
        if self.is_first:
            x = self.model.embed(x, documents=docs)
        x = self.model.run_layers(x, first_layer=self.first_layer, documents=docs)
        out = self.model.loss_input(x) if self.is_last else x  # the logits, or the chunked loss's input
        # the stage's MoE router losses train through its output's backward (the loss is the last stage's)
        out = attach_aux_losses(self.model, out) if self.training else out
        return out if self.is_last or docs is None else (out, docs)


def stage_placement(pp_size: int, virtual_stages: int, placement: str = "loop") -> list[list[int]]:
    """Stage indices owned by each pp rank: ``result[pp_rank]``, in execution order."""
    if placement not in PLACEMENTS:
        raise ValueError(f"stage placement {placement!r} is not one of {PLACEMENTS}")
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(f"'v' placement needs virtual_stages=2 (ZB-V), got {virtual_stages}")
        return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]
    return [[r + k * pp_size for k in range(virtual_stages)] for r in range(pp_size)]


def _init_like_full_model(full: Transformer, kept: set[int]) -> None:
    """Replay the draws of ``build_model``; write only into modules in ``kept``.

    Two passes, as on CPU: the torch constructors' own ``reset_parameters`` (nn.Linear's
    kaiming-uniform, nn.Embedding's normal), in creation order (= ``modules()`` order
    here), then ``model.init_weights_`` per module, as ``Transformer.reset_parameters``.
    The tests check the result against ``build_model`` bit for bit, so a change in
    model.py's init fails loudly there.
    """
    with torch.no_grad():
        for module in full.modules():
            if module is full:  # its own parameter (output_bias) draws nothing; split_into_stages sets it
                continue
            if not hasattr(module, "reset_parameters") or not list(module.parameters(recurse=False)):
                continue
            target = module if id(module) in kept else copy.deepcopy(module).to_empty(device="cpu")
            reset = getattr(target, "reset_parameters", None)  # a scratch twin draws the same numbers, then is dropped
            assert callable(reset), type(target)
            reset()
        for module in full.modules():
            if module is full or not list(module.parameters(recurse=False)):
                continue
            target = module if id(module) in kept else copy.deepcopy(module).to_empty(device="cpu")
            init_weights_(target, full.cfg)  # a twin advances the generator exactly as the full draw


def split_into_stages(
    model_cfg: ModelConfig,
    pp_size: int,
    pp_rank: int,
    *,
    balance: str = "layers",
    stage_layers: list[int] | None = None,
    virtual_stages: int = 1,
    placement: str = "loop",
    seed: int,
    device: str | torch.device = "cpu",
    draw: bool = True,
) -> list[StageModule]:
    """Build this rank's stage modules (one per virtual stage), weights equal to the single model's.

    The stages' global indices are ``stage_placement(pp_size, virtual_stages, placement)[pp_rank]``. ``draw``
    False leaves the weights uninitialised (no replay of the whole model's draws): for a caller that loads every
    one of them (``train.init_from``).
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size}) with pp_size >= 1")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages} must be >= 1")
    num_stages = pp_size * virtual_stages
    counts = layers_per_stage(model_cfg, num_stages, balance, stage_layers)  # the planner prices the same split
    starts = [sum(counts[:s]) for s in range(num_stages)]
    mine = stage_placement(pp_size, virtual_stages, placement)[pp_rank]
    seq2seq = model_cfg.encoder_decoder
    k = encoder_stage_count(model_cfg, counts) if seq2seq else None  # stages 0..k-1 hold the encoder

    with torch.device("meta"):
        full = Transformer(model_cfg)
    # keep[s]: the top-level pieces of stage s (layers by global index)
    pieces: dict[int, dict[str, nn.Module | None]] = {}
    tail = [name for name in LAST_STAGE_MODULES if name not in LAST_STAGE_PARAMETERS]
    for s in mine:
        first, last = s == 0, s == num_stages - 1
        pieces[s] = {name: getattr(full, name) if first else None for name in FIRST_STAGE_MODULES}
        pieces[s].update({name: getattr(full, name) if last else None for name in tail})
        if last and full.head is None:  # a tied head: the last stage's own copy of the token embedding
            pieces[s]["tok_emb"] = full.tok_emb
        pieces[s]["layers"] = nn.ModuleList(full.layers[starts[s]:starts[s] + counts[s]])
        if k is not None:  # encoder-decoder: the stack's ends, the decoder's embedding copy, its layers
            assert full.dec_layers is not None
            n_enc = model_cfg.n_layers
            pieces[s].update({name: getattr(full, name) if s == k - 1 else None for name in ENCODER_LAST_MODULES})
            pieces[s].update({name: getattr(full, name) if first else None for name in DECODER_FIRST_MODULES})
            pieces[s]["layers"] = nn.ModuleList(full.layers[starts[s]:min(starts[s] + counts[s], n_enc)])
            pieces[s]["dec_layers"] = nn.ModuleList(
                full.dec_layers[max(starts[s] - n_enc, 0):max(starts[s] + counts[s] - n_enc, 0)])
    kept_roots = {id(m): m for p in pieces.values() for m in p.values() if m is not None}
    for m in kept_roots.values():
        m.to_empty(device="cpu")
        for layer in moe_layers(m):  # a buffer no parameter draw reaches: its initial value (a checkpoint's later)
            layer.reset_expert_bias()
    kept = {id(sub) for m in kept_roots.values() for sub in m.modules()}
    torch.manual_seed(seed)  # build_model(cfg, seed=seed) seeds the same way, then draws on CPU
    if draw:
        _init_like_full_model(full, kept)

    stages = []
    for s in mine:
        with torch.device("meta"):
            model = Transformer(model_cfg)
        for name, module in pieces[s].items():
            # a tied head on the last stage is this rank's own tok_emb: the same module as
            # stage 0's when this rank owns both (pp_size 1), a second copy on another rank
            setattr(model, name, module)
        for name in LAST_STAGE_PARAMETERS:  # the model's own parameters: the last stage's, drawn as in init_weights_
            meta = getattr(model, name)
            if meta is not None:
                setattr(model, name, nn.Parameter(torch.empty(meta.shape)) if s == num_stages - 1 else None)
        if s == num_stages - 1:
            init_weights_(model, model_cfg)  # a Transformer's own parameters only (output_bias: zeros)
        model._init_buffers()  # rope / sinusoidal tables, recomputed on CPU
        stages.append(StageModule(model, s, num_stages, starts[s], k).to(device))
    return stages

