"""Pipeline stages: split the one model into pp_size (x virtual) stages, build only this rank's.

Layout (Megatron / torchtitan): the first stage owns the embeddings, the last the final
norm and the head; the layer stack is cut into contiguous runs, balanced by layer count or
by parameter count, or given explicitly (``stage_layers``). With ``virtual_stages`` v > 1
there are pp_size * v stages; rank r owns stages r, r + pp_size, ... ("loop" placement,
Narayanan et al. 2021, section 2.2, the interleaved schedule) or, for the zero-bubble V
schedule, r and 2 * pp_size - 1 - r ("v" placement, Qi et al. 2024, ZB-V).

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
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dist_trainer.config import ModelConfig
from dist_trainer.model import Transformer, init_weights_

BALANCES = ("layers", "params")
PLACEMENTS = ("loop", "v")


class StageModule(nn.Module):
    """One pipeline stage: a trimmed ``Transformer`` holding only this stage's modules.

    forward: (B, T) tokens on the first stage, else (B, T, C) hidden state -> (B, T, C)
    hidden state, or (B, T, V) logits on the last stage. ``model.layers[i]`` is global layer
    ``first_layer + i`` (activation checkpointing and checkpoints use global indices).
    """

    def __init__(self, model: Transformer, stage_index: int, num_stages: int, first_layer: int) -> None:
        super().__init__()
        self.model = model
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.first_layer = first_layer

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.first_layer + len(self.model.layers))

    def set_activation_checkpointing(self, mode: str, every: int = 1) -> None:
        """As ``Transformer.set_activation_checkpointing``, on global layer indices.

        ``run_layers`` looks layers up by global index (``first_layer + i``), so every_k
        checkpoints the same layers as in the single model whatever the stage boundaries.
        """
        self.model.set_activation_checkpointing(mode, every)  # validates mode
        if mode == "every_k":
            self.model.checkpointed = frozenset(i for i in self.layer_ids if i % every == 0)
        else:
            self.model.checkpointed = frozenset(i + self.first_layer for i in self.model.checkpointed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.model.embed(x)
        x = self.model.run_layers(x, first_layer=self.first_layer)
        return self.model.logits(x) if self.is_last else x


def stage_placement(pp_size: int, virtual_stages: int, placement: str = "loop") -> list[list[int]]:
    """Stage indices owned by each pp rank: ``result[pp_rank]``, in execution order."""
    if placement not in PLACEMENTS:
        raise ValueError(f"stage placement {placement!r} is not one of {PLACEMENTS}")
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(f"'v' placement needs virtual_stages=2 (ZB-V), got {virtual_stages}")
        return [[r, 2 * pp_size - 1 - r] for r in range(pp_size)]
    return [[r + k * pp_size for k in range(virtual_stages)] for r in range(pp_size)]


def _layer_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(params of one block, of the first stage's extras, of the last stage's extras), from a meta model."""
    with torch.device("meta"):
        model = Transformer(cfg)

    def count(*mods: nn.Module | None) -> int:
        return sum(p.numel() for m in mods if m is not None for p in m.parameters())

    block = count(model.layers[0])
    first = count(model.tok_emb, model.pos_emb, model.type_emb, model.emb_norm)
    tied_head = model.tok_emb.weight.numel() if model.head is None else 0
    last = count(model.final_norm, model.head, model.pooler) + tied_head
    return block, first, last


def layers_per_stage(cfg: ModelConfig, num_stages: int, balance: str = "layers") -> list[int]:
    """Contiguous layer counts per stage (each >= 1) summing to n_layers.

    ``layers``: as even as possible, the remainder going to the middle stages first (the
    first and last also hold the embeddings and the head). ``params``: minimise the largest
    stage's parameter count, embeddings and head included (exact DP over the cut points).
    """
    n = cfg.n_layers
    if balance not in BALANCES:
        raise ValueError(f"pipeline balance {balance!r} is not one of {BALANCES}")
    if n < num_stages:
        raise ValueError(
            f"model.n_layers={n} is fewer than the {num_stages} pipeline stages (pp_size x virtual stages); "
            f"use at most {n} stages or a deeper model"
        )
    if balance == "layers":
        base, extra = divmod(n, num_stages)
        # extra layers go to the middle stages first: the ends also run the embeddings and the head
        order = [*range(1, num_stages - 1), num_stages - 1, 0][:num_stages] if num_stages > 1 else [0]
        counts = [base] * num_stages
        for s in order[:extra]:
            counts[s] += 1
        return counts
    block, first, last = _layer_params(cfg)
    # best[s][k]: smallest max-stage cost placing the first k layers on stages 0..s-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        extra_cost = (first if s == 1 else 0) + (last if s == num_stages else 0)
        for k in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, k):
                cost = max(best[s - 1][j], (k - j) * block + extra_cost)
                if cost < best[s][k]:
                    best[s][k], cut[s][k] = cost, j
    counts, k = [], n
    for s in range(num_stages, 0, -1):
        counts.append(k - cut[s][k])
        k = cut[s][k]
    return counts[::-1]


def _validate_stage_layers(stage_layers: list[int], cfg: ModelConfig, num_stages: int) -> None:
    if len(stage_layers) != num_stages or sum(stage_layers) != cfg.n_layers or min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers={stage_layers} must list {num_stages} counts (pp_size x virtual stages), "
            f"each >= 1, summing to model.n_layers={cfg.n_layers}"
        )


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
            if not hasattr(module, "reset_parameters") or not list(module.parameters(recurse=False)):
                continue
            target = module if id(module) in kept else copy.deepcopy(module).to_empty(device="cpu")
            reset = getattr(target, "reset_parameters", None)  # a scratch twin draws the same numbers, then is dropped
            assert callable(reset), type(target)
            reset()
        for module in full.modules():
            if not list(module.parameters(recurse=False)):
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
) -> list[StageModule]:
    """Build this rank's stage modules (one per virtual stage), weights equal to the single model's.

    The stages' global indices are ``stage_placement(pp_size, virtual_stages, placement)[pp_rank]``.
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size}) with pp_size >= 1")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages} must be >= 1")
    num_stages = pp_size * virtual_stages
    if stage_layers is not None:
        _validate_stage_layers(list(stage_layers), model_cfg, num_stages)
        counts = list(stage_layers)
    else:
        counts = layers_per_stage(model_cfg, num_stages, balance)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    mine = stage_placement(pp_size, virtual_stages, placement)[pp_rank]

    with torch.device("meta"):
        full = Transformer(model_cfg)
    # keep[s]: the top-level pieces of stage s (layers by global index)
    pieces: dict[int, dict[str, nn.Module | None]] = {}
    for s in mine:
        first, last = s == 0, s == num_stages - 1
        pieces[s] = {
            "tok_emb": full.tok_emb if first or (last and full.head is None) else None,
            "pos_emb": full.pos_emb if first else None,
            "type_emb": full.type_emb if first else None,
            "emb_norm": full.emb_norm if first else None,
            "final_norm": full.final_norm if last else None,
            "head": full.head if last else None,
            "pooler": full.pooler if last else None,
            "layers": nn.ModuleList(full.layers[starts[s]:starts[s] + counts[s]]),
        }
    kept_roots = {id(m): m for p in pieces.values() for m in p.values() if m is not None}
    for m in kept_roots.values():
        m.to_empty(device="cpu")
    kept = {id(sub) for m in kept_roots.values() for sub in m.modules()}
    torch.manual_seed(seed)  # build_model(cfg, seed=seed) seeds the same way, then draws on CPU
    _init_like_full_model(full, kept)

    stages = []
    for s in mine:
        with torch.device("meta"):
            model = Transformer(model_cfg)
        for name, module in pieces[s].items():
            # a tied head on the last stage is this rank's own tok_emb: the same module as
            # stage 0's when this rank owns both (pp_size 1), a second copy on another rank
            setattr(model, name, module)
        model._init_buffers()  # rope / sinusoidal tables, recomputed on CPU
        stages.append(StageModule(model, s, num_stages, starts[s]).to(device))
    return stages

