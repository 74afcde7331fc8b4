"""What document masking (``data.document_masking``, packed sequences) adds to the saved activations.

Measured against a saved-tensor hook (tests/test_document_masking.py), on top of ``activations.py``'s lists:

* the attention mask: one bool (s, s) block-diagonal mask per sequence (``model_positions.same_document``) instead of
  none, or of the one (s, s) mask a sliding window shares over the micro-batch; a flash kernel keeps it as an
  additive mask in q's dtype, the soft-capped explicit attention as the bool it fills, the math kernel folds it into
  the probabilities it keeps anyway (``ActivationSpec.masks``, used where ``activations.py`` prices those masks);
  ring attention keeps none: it rebuilds each block's mask from the segment ids in backward;
* RoPE: each layer's (b, 1, s, rotary_dim/2) fp32 cos and sin gathered at the tokens' positions within their
  documents, which the rotation keeps for q's and k's gradients (the unpacked tables are buffers, not activations);
* learned positions: the embedding's int64 position ids, which its backward reads;
* selective recomputation: the int64 segment ids of the whole sequence, an input of every recomputed core (one
  tensor for the stage's layers).

``activation_costs.py`` adds these lists to the layers' and the embedding's. No attention work is saved on the
CPU: SDPA with an explicit mask computes every score and hides the masked ones (docs/data.md, "Document
masking"); ``compute.py``'s attention FLOPs stay the causal figure. A CUDA kernel that skips the masked blocks would
save about the share of cross-document pairs; none is wired in, so none is priced.
"""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.planner.activation_spec import ActivationSpec, SavedTensor


def document_layer_tensors(cfg: ModelConfig, spec: ActivationSpec, *, rotated: bool) -> list[SavedTensor]:
    """A layer's RoPE tables at per-document positions, when its attention core runs (``rotated``: q or k needs
    its gradient) and is not recomputed."""
    if not spec.documents or cfg.pos_embedding != "rope" or not rotated:
        return []
    return [SavedTensor(f"attn.rope_{n}_by_document", cfg.rotary_dim / 2, 4) for n in ("cos", "sin")]


def document_embedding_tensors(cfg: ModelConfig, spec: ActivationSpec,
                               trains: frozenset[str] | None = None) -> list[SavedTensor]:
    """The first stage's position ids of a learned table (sinusoidal tables are buffers: nothing kept); ``trains``:
    the first-stage modules that train (None: all)."""
    if not spec.documents or cfg.pos_embedding != "learned" or (trains is not None and "pos_emb" not in trains):
        return []
    return [SavedTensor("embedding.position_ids", 1, 8)]


def document_stage_tensors(spec: ActivationSpec, selective: bool) -> list[SavedTensor]:
    """The stage's segment ids (whole sequences, int64) that selective recomputation keeps for its cores."""
    if not spec.documents or not selective:
        return []
    return [spec.per_batch("attn.documents", spec.micro_batch_size * spec.seq_len, 8)]
