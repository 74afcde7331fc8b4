"""The one model definition: GPT-2, Llama, BERT and encoder-decoder (Transformer, T5) families from one ModelConfig.

Pure torch: nothing here knows how it is parallelised. Regimes rewrite modules by
name (``parallel/tp/apply.py``), split ``layers`` into stages
(``parallel/pipeline/split.py``) or hand the module to DeepSpeed. The loss is a module
(``self.loss``) so that tensor parallelism can swap in a vocab-parallel one.

Module names (the TP plan refers to them):
  tok_emb, pos_emb, type_emb, emb_norm,
  layers.{i}.attn_norm, layers.{i}.attn.{q,k,v,o}_proj, layers.{i}.attn.{q,k}_norm (model.qk_norm),
  layers.{i}.attn_post_norm (model.norm_placement=sandwich),
  layers.{i}.mlp_norm, layers.{i}.mlp.{up,gate,down}_proj, layers.{i}.mlp_post_norm (sandwich),
  final_norm, mlm_transform.{dense,norm} and output_bias (a parameter of the model itself; model.mlm_head),
  head (absent when tied), pooler, loss
A mixture-of-experts layer (``model.n_experts`` > 0, ``model_moe.py``) holds ``layers.{i}.moe.{router,
experts.{e}.*, shared_expert.*}`` in place of ``layers.{i}.mlp``.
An encoder-decoder (``model.n_decoder_layers`` > 0, ``model_seq2seq.py``, docs/seq2seq.md) adds rel_emb (T5's
relative table), enc_norm, dec_pos_emb, dec_rel_emb and dec_layers.{j}.{attn_norm, attn.*, cross_norm,
cross_attn.{q,k,v,o}_proj, mlp_norm, mlp.*}; ``layers`` is its encoder.

With ``model.lora_rank`` > 0 the ``model.lora_targets`` linears are ``model_lora.LoRALinear``s (their
adapters are ``<linear>.lora_A`` / ``.lora_B``) and every base parameter is frozen (``finetune.py``).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dist_trainer.config import ModelConfig
from dist_trainer.model_blocks import (
    MLP,
    Attention,
    Block,
    LMLoss,
    MLMTransform,
    Sequence,
    build_norm,
    init_weights_,
    softcap,
)
from dist_trainer.model_lora import LoRALinear, is_adapter
from dist_trainer.model_loss import ChunkedLoss
from dist_trainer.model_mla import MLAttention
from dist_trainer.model_moe import add_aux_losses
from dist_trainer.model_offload import ActivationOffload, LiveBytes
from dist_trainer.model_positions import RelativePositionBias, rope_cache, sinusoidal_table
from dist_trainer.model_recompute import op_recompute_contexts
from dist_trainer.model_seq2seq import DecoderBlock, KVCache, LayerCache, attention_mask

SEQ2SEQ_INPUTS = ("decoder_tokens", "source_mask")  # an encoder-decoder batch's inputs beside tokens and targets
# a packed batch's segment ids (B, T): tokens attend within their segment, positions restart at each (docs/data.md)
DOCUMENTS = "documents"


def seq2seq_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs ``Transformer.forward`` takes from a batch besides tokens and targets: an encoder-decoder's
    and a packed batch's ``documents`` (none for one stack's plain batch)."""
    return {k: batch[k] for k in (*SEQ2SEQ_INPUTS, DOCUMENTS) if k in batch}


class Transformer(nn.Module):
    """Decoder (causal LM), encoder (masked LM) or encoder-decoder (``model.n_decoder_layers`` > 0, sequence to
    sequence: ``model_seq2seq.py``) transformer, configured by ModelConfig.

    An encoder-decoder's encoder is ``layers`` (bidirectional), closed by ``enc_norm`` (pre-norm); its decoder is
    ``dec_layers``, closed by ``final_norm`` and the head. One token embedding serves both stacks (and the head
    when tied); learned positions and T5's relative bias are per stack (``pos_emb``/``rel_emb`` for the encoder,
    ``dec_pos_emb``/``dec_rel_emb`` for the decoder); no stack has an embedding norm (Vaswani et al.'s post-norm
    model normalises after each sub-layer only).
    """

    # buffers, registered by _init_buffers for the position embedding in use
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor  # model.rope_local_theta: the sliding layers' own table
    rope_local_sin: torch.Tensor
    pos_table: torch.Tensor
    output_bias: nn.Parameter | None  # registered in __init__ (None without model.mlm_head)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        seq2seq, post = cfg.encoder_decoder, cfg.norm_placement == "post"
        learned, relative = cfg.pos_embedding == "learned", cfg.pos_embedding == "relative"
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if learned else None
        self.type_emb = nn.Embedding(cfg.n_token_types, cfg.d_model) if cfg.n_token_types else None
        self.rel_emb = self._relative_bias(bidirectional=True) if relative else None
        self.emb_norm = build_norm(cfg) if post and not seq2seq else None  # BERT normalises the embedding sum
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i, causal=False if seq2seq else None,
                                          attn=MLAttention(cfg) if cfg.mla else None) for i in range(cfg.n_layers))
        self.enc_norm = build_norm(cfg) if seq2seq and not post else None  # the encoder stack's final norm
        self.dec_pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if seq2seq and learned else None
        self.dec_rel_emb = self._relative_bias(bidirectional=False) if relative else None
        self.dec_layers = nn.ModuleList(self._decoder_block() for _ in range(cfg.n_decoder_layers)) if seq2seq \
            else None
        self.final_norm = None if post else build_norm(cfg)  # post-norm layers end normalised
        self.mlm_transform = MLMTransform(cfg) if cfg.mlm_head else None
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # BERT's decoder bias (cls.predictions.bias): on the model, beside a head that may be the tied embedding
        self.register_parameter("output_bias", nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.mlm_head else None)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias) if cfg.pooler else None
        self.nsp_head = nn.Linear(cfg.d_model, 2) if cfg.nsp_head else None  # BERT's cls.seq_relationship
        self.loss: nn.Module = LMLoss()
        if cfg.loss_chunk_tokens:  # the loss takes the head's input and projects it chunk by chunk (model_loss.py)
            self.loss = ChunkedLoss(self.loss, self.project, cfg.loss_chunk_tokens)
        # Declared seams (identities in one process) where tensor parallelism swaps in its collectives
        # (parallel/tp/apply.py), so what runs is read here: the head's input enters the TP region (f, or SP's
        # all-gather), generation gathers the vocabulary shards of the logits, the pooler gathers SP's shards.
        self.sequence = Sequence()  # which tokens of each sequence this rank holds (embed)
        self.head_input: nn.Module = nn.Identity()
        self.full_logits: nn.Module = nn.Identity()
        self.pool_input: nn.Module = nn.Identity()
        self.checkpointed: frozenset[int] = frozenset()
        self.recompute_ops = False  # op-level: the checkpointed layers keep matmul and attention outputs
        self.offloaded: frozenset[int] = frozenset()  # layers whose saved tensors go to host memory
        self.offload = ActivationOffload()
        self.kept = LiveBytes()  # op-level recomputation: the bytes its policy's caches hold (model_recompute.py)
        for name, module in self.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_key = name  # the adapter's generator is seeded by its name (model_lora.init_adapter_)
        for name, p in self.named_parameters():
            if cfg.lora_rank and not is_adapter(name):
                p.requires_grad_(False)  # LoRA trains the adapters only (Hu et al. 2021, section 4.1)
        self._init_buffers()
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def _relative_bias(self, bidirectional: bool) -> RelativePositionBias:
        cfg = self.cfg
        return RelativePositionBias(cfg.n_heads, cfg.rel_buckets, cfg.rel_max_distance, bidirectional)

    def _decoder_block(self) -> DecoderBlock:
        cfg = self.cfg
        return DecoderBlock(attn_norm=build_norm(cfg), attn=Attention(cfg, causal=True), cross_norm=build_norm(cfg),
                            cross_attn=Attention(cfg, causal=False), mlp_norm=build_norm(cfg), mlp=MLP(cfg),
                            dropout=cfg.dropout, pre_norm=cfg.norm_placement == "pre")

    def _init_buffers(self) -> None:
        cfg = self.cfg
        if cfg.pos_embedding == "rope":
            cos, sin = rope_cache(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            if cfg.rope_local_theta is not None:
                cos, sin = rope_cache(cfg, local=True)
                self.register_buffer("rope_local_cos", cos, persistent=False)
                self.register_buffer("rope_local_sin", sin, persistent=False)
        elif cfg.pos_embedding == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.d_model), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every module's ``init_weights_`` in module order, then the position tables.

        Parameters are drawn in module order from the global RNG, so the same seed gives
        the same model in every regime (TP shards are cut from this full draw; pipeline
        stages and ZeRO-3 replay the same per-module draws).
        """
        for module in self.modules():
            init_weights_(module, self.cfg)
        if self.cfg.pos_embedding in ("rope", "sinusoidal"):
            self._init_buffers()  # recompute after to_empty() left them uninitialised

    def set_activation_checkpointing(self, mode: str, every: int = 1, first_layer: int = 0) -> None:
        """none | selective (every layer's attention core) | every_k (layers whose global index % every == 0) |
        full | op (every layer, keeping the outputs of its attention and every other matmul: model_recompute).
        Layers are numbered over both stacks of an encoder-decoder: decoder layer j is layer n_layers + j.
        ``first_layer``: the global index of the first layer this model holds (a pipeline stage's), which the layer
        loops are given too, so every_k recomputes the same layers as the single model whatever the stages."""
        ids = range(first_layer, first_layer + len(self.layers) + len(self.dec_layers or ()))
        for module in self.modules():
            if isinstance(module, Attention | MLAttention):
                module.recompute_core = mode == "selective"
        self.recompute_ops = mode == "op"
        if mode in ("none", "selective"):
            self.checkpointed = frozenset()
        elif mode in ("full", "op"):
            self.checkpointed = frozenset(ids)
        elif mode == "every_k":
            self.checkpointed = frozenset(i for i in ids if i % every == 0)
        else:
            raise ValueError(f"activation checkpointing mode {mode!r} is not none, selective, every_k, full or op")

    def set_activation_offload(self, share: float, first_layer: int = 0) -> None:
        """Offload the saved tensors of the first ceil(share x n) of the n layers this model holds (global indices
        from ``first_layer``; decoder layers after the encoder's): the earliest forward, the latest backward."""
        n = len(self.layers) + len(self.dec_layers or ())
        self.offloaded = frozenset(range(first_layer, first_layer + math.ceil(share * n - 1e-9)))

    def _offloading(self, i: int, x: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        if i in self.offloaded and torch.is_grad_enabled():
            return self.offload.layer(x)
        return contextlib.nullcontext()

    def checkpoint_options(self) -> dict[str, Any]:
        """``torch.utils.checkpoint`` keywords of a checkpointed layer: op-level recomputation's selective policy."""
        return {"context_fn": partial(op_recompute_contexts, self.kept)} if self.recompute_ops else {}

    def embed(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None, *, decoder: bool = False,
              start: int = 0, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C) input of the first layer (of the decoder stack with ``decoder``; ``start``:
        the position of the first token, during generation; where the sequence is split over ranks: of this rank's
        tokens, ``sequence.shard``, at their global positions; ``documents`` (B, T): positions restart at each
        segment)."""
        if start + tokens.shape[1] > self.cfg.max_seq_len:
            raise RuntimeError(f"sequence length {start + tokens.shape[1]} exceeds model.max_seq_len="
                               f"{self.cfg.max_seq_len}")
        tokens = self.sequence.shard(tokens)
        T = tokens.shape[1]
        x = self.tok_emb(tokens)
        if self.cfg.scale_embeddings:  # Vaswani et al. 2017, section 3.4; the factor in x's dtype, as Gemma's
            x = x * torch.tensor(math.sqrt(self.cfg.d_model), dtype=x.dtype, device=x.device)
        if self.cfg.embedding_multiplier != 1.0:  # Granite
            x = x * self.cfg.embedding_multiplier
        pos_emb = self.dec_pos_emb if decoder else self.pos_emb
        if documents is not None and (pos_emb is not None or self.cfg.pos_embedding == "sinusoidal"):
            table = pos_emb.weight if pos_emb is not None else self.pos_table
            x = x + self.sequence.rows_at(table, documents).to(x.dtype)
        elif pos_emb is not None:
            x = x + self.sequence.rows(pos_emb.weight[start:], T)
        elif self.cfg.pos_embedding == "sinusoidal":
            x = x + self.sequence.rows(self.pos_table[start:], T).to(x.dtype)
        if self.type_emb is not None:
            types = torch.zeros_like(tokens) if token_types is None else self.sequence.shard(token_types)
            x = x + self.type_emb(types)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.emb_drop(x)

    def rope(self, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The RoPE (cos, sin) tables global layer ``layer`` reads: a sliding layer its own local table when
        model.rope_local_theta gives one (Gemma 3), every other layer the global table; None without RoPE."""
        if self.cfg.pos_embedding != "rope":
            return None
        if layer is not None and self.cfg.rope_local_theta is not None and self.cfg.is_sliding_layer(layer):
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def position_bias(self, decoder: bool, q_len: int, k_len: int | None = None, offset: int = 0
                      ) -> torch.Tensor | None:
        """A stack's relative-position bias (1, H, q_len, k_len), computed once and shared by its layers (T5);
        None without relative positions."""
        table = self.dec_rel_emb if decoder else self.rel_emb
        return None if table is None else table(q_len, q_len if k_len is None else k_len, offset)

    def run_layers(self, x: torch.Tensor, first_layer: int = 0, mask: torch.Tensor | None = None,
                   caches: list[KVCache] | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """The (encoder) stack's layers, ``layers[i]`` being global layer ``first_layer + i``; ``mask``: an SDPA mask
        for their self-attention (``model_seq2seq.attention_mask``); ``caches``: one KVCache per layer during
        generation (``x`` then follows the caches' length of earlier tokens); ``documents``: the (B, T) segment ids
        of packed sequences, each attending within its own."""
        for j, layer in enumerate(self.layers):
            i, rope = first_layer + j, self.rope(first_layer + j)
            # the segment ids as a keyword: a recomputed layer keeps them by reference, not as a saved input
            run = layer if documents is None else partial(layer, documents=documents)
            if caches is not None:
                x = layer(x, rope, mask, caches[j])
                continue
            with self._offloading(i, x):
                if i in self.checkpointed and torch.is_grad_enabled():
                    x = checkpoint(run, x, rope, mask, use_reentrant=False, **self.checkpoint_options())
                else:
                    x = run(x, rope, mask)
        return x

    def encoder_output(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden state -> the memory the decoder attends to (after ``enc_norm``, pre-norm)."""
        return x if self.enc_norm is None else self.enc_norm(x)

    def run_decoder_layers(self, y: torch.Tensor, memory: torch.Tensor, self_mask: torch.Tensor | None,
                           cross_mask: torch.Tensor | None, first_layer: int | None = None,
                           caches: list[LayerCache] | None = None) -> torch.Tensor:
        """The decoder stack's layers over ``memory`` (B, S, C); ``dec_layers[j]`` is global layer ``first_layer + j``
        (default n_layers: numbered after the encoder's)."""
        assert self.dec_layers is not None, "run_decoder_layers needs an encoder-decoder (model.n_decoder_layers > 0)"
        first = self.cfg.n_layers if first_layer is None else first_layer
        for j, layer in enumerate(self.dec_layers):
            cache = None if caches is None else caches[j]
            if cache is not None:
                y = layer(y, memory, self_mask, cross_mask, cache)
                continue
            with self._offloading(first + j, y):
                if first + j in self.checkpointed and torch.is_grad_enabled():
                    y = checkpoint(layer, y, memory, self_mask, cross_mask, use_reentrant=False,
                                   **self.checkpoint_options())
                else:
                    y = layer(y, memory, self_mask, cross_mask, cache)
        return y

    def encode(self, tokens: torch.Tensor, source_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) source ids (``source_mask`` (B, S): False at padding) -> (B, S, C) encoder output."""
        bias = self.position_bias(False, tokens.shape[1])
        x = self.run_layers(self.embed(tokens), mask=attention_mask(bias, source_mask, causal=False))
        return self.encoder_output(x)

    def decode(self, decoder_tokens: torch.Tensor, memory: torch.Tensor, source_mask: torch.Tensor | None = None,
               caches: list[LayerCache] | None = None) -> torch.Tensor:
        """(B, T) decoder inputs over the encoder output -> (B, T, C) last hidden state. With ``caches`` the tokens
        follow the ``caches[0]``'s length of earlier ones (generation: keys and values kept, cross-attention's
        projected once)."""
        start = 0 if caches is None else caches[0].self_attn.length
        T = decoder_tokens.shape[1]
        bias = self.position_bias(True, T, start + T, offset=start)
        # the first pass is causal; a later step's queries follow every cached key
        self_mask = attention_mask(bias, None, causal=start == 0)
        y = self.embed(decoder_tokens, decoder=True, start=start)
        return self.run_decoder_layers(y, memory, self_mask, attention_mask(None, source_mask, causal=False),
                                       caches=caches)

    def hidden_states(self, tokens: torch.Tensor, token_types: torch.Tensor | None = None,
                      decoder_tokens: torch.Tensor | None = None, source_mask: torch.Tensor | None = None,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden state the head reads: one stack's, or the decoder's over the encoded ``tokens``."""
        if self.dec_layers is None:
            return self.run_layers(self.embed(tokens, token_types, documents=documents), documents=documents)
        if documents is not None:
            raise ValueError("an encoder-decoder does not pack documents (data.document_masking is for one stack)")
        if decoder_tokens is None:
            raise ValueError("an encoder-decoder model needs decoder_tokens (the targets shifted right)")
        return self.decode(decoder_tokens, self.encode(tokens, source_mask), source_mask)

    def output_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.head is None else self.head.weight

    def pre_head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) last hidden state -> what the output projection reads: the final norm, BERT's MLM transform,
        T5's d_model**-0.5 before a tied head."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.mlm_transform is not None:
            x = self.mlm_transform(x)
        return x * self.cfg.d_model ** -0.5 if self.cfg.scale_head_input else x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) last hidden state -> (B, T, V) logits (``pre_head``, then the head; under TP this rank's
        vocabulary shard, which ``loss`` consumes), divided by model.logits_divisor (Granite) and soft-capped by
        model.final_softcap (Gemma 2): both elementwise, so a vocabulary shard is treated as the whole."""
        return self.project(self.head_input(self.pre_head(x)))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The head's input (after ``pre_head`` and the ``head_input`` seam) -> logits (module ``logits``)."""
        logits = F.linear(x, self.output_weight(), self.output_bias)
        if self.cfg.logits_divisor != 1.0:
            logits = logits / self.cfg.logits_divisor
        return softcap(logits, self.cfg.final_softcap) if self.cfg.final_softcap else logits

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT pooler: tanh(dense(first token)). Not part of the MLM loss."""
        if self.pooler is None:
            raise RuntimeError("this model has no pooler (model.pooler=false)")
        return torch.tanh(self.pooler(self.pool_input(hidden)[:, 0]))

    def next_sentence(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's next-sentence logits (B, 2) from the last hidden state: ``nsp_head(pool(hidden))`` (index 0: the
        second segment follows the first). Not part of the MLM loss."""
        if self.nsp_head is None:
            raise RuntimeError("this model has no next-sentence head (model.nsp_head=false)")
        return self.nsp_head(self.pool(hidden))

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        token_types: torch.Tensor | None = None,
        *,
        decoder_tokens: torch.Tensor | None = None,
        source_mask: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) when targets is None, else the scalar mean loss (in training, plus the MoE layers'
        router losses). An encoder-decoder reads source ``tokens`` (``source_mask``: False at padding) and
        ``decoder_tokens``; its logits and targets are the decoder's. ``documents`` (B, T): the segment id of each
        position of packed sequences (docs/data.md, "Document masking")."""
        hidden = self.hidden_states(tokens, token_types, decoder_tokens, source_mask, documents)
        if targets is None:
            return self.full_logits(self.logits(hidden))
        return add_aux_losses(self, self.loss(self.loss_input(hidden), targets))

    def loss_input(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) last hidden state -> what ``loss`` takes: the logits, or with model.loss_chunk_tokens the head's
        input, which the chunked loss projects a chunk at a time (``model_loss.py``)."""
        if self.cfg.loss_chunk_tokens:
            return self.head_input(self.pre_head(x))
        return self.logits(x)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied weight counts once); a ZeRO-3 partition counts its full size (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in {id(p): p for p in model.parameters()}.values())


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """The model, initialised on CPU from ``seed`` (so every regime draws the same weights)."""
    if seed is not None:
        torch.manual_seed(seed)
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return Transformer(cfg)
    return Transformer(cfg).to(device)
