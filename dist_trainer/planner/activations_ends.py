"""The saved tensors of the model's ends (``activations.py``'s docstring says how each is counted): the embedding
before layer 0 on the first stage; the final norm, BERT's MLM transform, the head's input, the vocabulary-wide
tensors of the logits and the loss on the last stage (whole, or a chunk at a time: ``model.loss_chunk_tokens``,
``loss_costs.py``), and the gradients the loss's backward makes beside them."""

from __future__ import annotations

from dist_trainer.config import ModelConfig
from dist_trainer.facts.model_names import FIRST_STAGE_MODULES, TAIL_NAMES
from dist_trainer.facts.model_shape import has_final_norm, padded_vocab
from dist_trainer.planner.activation_spec import ActivationSpec, SavedTensor, norm_saved_tensors


def embedding_saved_tensors(cfg: ModelConfig, spec: ActivationSpec,
                            trains: frozenset[str] | None = None) -> list[SavedTensor]:
    """First stage, before layer 0: token ids, segment ids, the embedding norm (post-norm) and dropout mask.

    ``trains``: the first-stage modules that train (None: all); a frozen table keeps no ids, and nothing keeps a
    dropout mask when no embedding module trains."""
    trains = frozenset(FIRST_STAGE_MODULES) if trains is None else trains
    out = []
    if "tok_emb" in trains:
        out.append(SavedTensor("embedding.token_ids", 1, 8))
        if spec.tp_size > 1:  # the vocab-parallel lookup keeps its bool "id outside my shard" mask
            out.append(SavedTensor("embedding.vocab_mask", 1, 1))
    if cfg.n_token_types and "type_emb" in trains:
        out.append(SavedTensor("embedding.type_ids", 1, 8))
    if cfg.scale_embeddings and "tok_emb" in trains:  # x * tensor(sqrt(d_model)): mul keeps the 0-d factor
        out.append(spec.per_batch("embedding.scale", 1, spec.residual))
    tables = bool(trains & {"tok_emb", "pos_emb", "type_emb"})
    if cfg.norm_placement == "post":
        out += norm_saved_tensors(cfg, spec, "emb_norm", tables, "emb_norm" in trains)
    if cfg.dropout > 0 and (tables or "emb_norm" in trains):
        mask = 1 if spec.device == "cuda" else spec.residual  # the embedding sum is in the residual dtype
        out.append(SavedTensor("embedding.dropout_mask", cfg.d_model * spec.rep, mask))
    return out


def head_saved_tensors(cfg: ModelConfig, spec: ActivationSpec, input_grad: bool = True,
                       trains: frozenset[str] | None = None) -> list[SavedTensor]:
    """Last stage: final norm (pre-norm), BERT's MLM transform (``model.mlm_head``), the head's input, the fp32
    log-softmax and the int64 targets.

    ``input_grad``: the last layer's output requires grad; ``trains``: of the last stage's modules
    (``model_names.TAIL_NAMES``), those that train (None: all; a tied head trains with the token embedding)."""
    trains = frozenset(TAIL_NAMES) if trains is None else trains
    pre = has_final_norm(cfg)
    out = norm_saved_tensors(cfg, spec, "final_norm", input_grad, "final_norm" in trains) if pre else []
    grad = input_grad or (pre and "final_norm" in trains)  # the head's (or the transform's) input requires grad
    if cfg.mlm_head:
        out += _mlm_transform(cfg, spec, grad, trains)
        grad = grad or bool(trains & {"mlm_transform.dense", "mlm_transform.norm"})
    chunked = bool(cfg.loss_chunk_tokens)
    if chunked and (grad or "head" in trains or "output_bias" in trains):
        # model_loss.ChunkedLoss: each chunk's checkpoint keeps its slice of the head's input (in its own dtype:
        # the residual stream's, the MLM transform's dense output's with one) and of the targets; the projection
        # and the loss run again in backward
        return [*out, SavedTensor("head.input", cfg.d_model * spec.lin_in, head_input_bytes(cfg, spec)),
                SavedTensor("loss.targets", 1, 8)]
    if "head" in trains:
        out.append(SavedTensor("head.input", cfg.d_model * spec.lin_in, spec.act))
    if not (grad or "head" in trains or "output_bias" in trains):
        return out  # the logits need no gradient: the loss keeps nothing
    return [*out, *head_vocab_saved_tensors(cfg, spec), SavedTensor("loss.targets", 1, 8)]


def head_input_bytes(cfg: ModelConfig, spec: ActivationSpec) -> int:
    """Bytes per element of the head's input as ``pre_head`` returns it: the residual stream's dtype, or the MLM
    transform's (its norm casts back to the dense's output dtype: 16-bit under autocast)."""
    return spec.act if cfg.mlm_head else spec.residual


def head_vocab_saved_tensors(cfg: ModelConfig, spec: ActivationSpec) -> list[SavedTensor]:
    """The vocabulary-wide tensors the head and the loss keep per token (when their whole micro-batch runs at once,
    or per token of one chunk in its backward): a final soft-cap's tanh, the fp32 log-softmax, TP's bool masks."""
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) if spec.tp_size > 1 else cfg.vocab_size
    out = []
    if cfg.final_softcap:  # c * tanh(logits / c): tanh keeps its output, in the logits' dtype
        out.append(SavedTensor("head.softcap_tanh", vocab / spec.tp_size, spec.act))
    out.append(SavedTensor("loss.log_softmax", vocab / spec.tp_size, 4))
    if spec.tp_size > 1:  # the vocab-parallel cross-entropy keeps two bool target-outside-shard masks
        out.append(SavedTensor("loss.vocab_masks", 2, 1))
    return out


def _mlm_transform(cfg: ModelConfig, spec: ActivationSpec, input_grad: bool, trains: frozenset[str]
                   ) -> list[SavedTensor]:
    """norm(activation(dense(x))) on the whole hidden state (a sequence shard under SP: it runs before the head's
    all-gather): the dense keeps its input for its weight's gradient, the activation its input (relu: its output),
    the norm its fp32 input and statistics. With fp32 activations relu's saved output is the norm's input itself."""
    h = cfg.d_model * spec.rep
    dense_trains = "mlm_transform.dense" in trains
    through = input_grad or dense_trains  # the activation's input requires grad
    out = [SavedTensor("mlm_transform.dense.input", h, spec.act)] if dense_trains else []
    if through:
        out.append(SavedTensor("mlm_transform.activation", h, spec.act))
    norm = norm_saved_tensors(cfg, spec, "mlm_transform.norm", through, "mlm_transform.norm" in trains)
    if cfg.activation == "relu" and spec.act == 4 and through:
        norm = [x for x in norm if x.name != "mlm_transform.norm.input"]  # the same fp32 tensor as relu's output
    return out + norm


def loss_backward_bytes_per_token(cfg: ModelConfig, spec: ActivationSpec) -> float:
    """Gradients the loss's backward makes while its saved log-softmax is still alive (not saved tensors).

    One process: ``F.cross_entropy(logits.float())`` is log_softmax + nll_loss; when backward starts, nll_loss's
    gradient (fp32, V per token) and log_softmax's (fp32, V) exist beside the saved fp32 log-softmax: 8V bytes.
    TP (``parallel/tp/layers._VocabParallelCrossEntropy``): the gradient is a clone of the saved fp32 softmax,
    4V/t, cast to the logits' dtype before it is returned (+2V/t for 16-bit logits). Measured on CPU in
    tests/test_planner_activations.py (8.0, 4.0 and 6.0 bytes per logit).
    """
    spec.validate()
    if spec.tp_size == 1:
        return 8.0 * cfg.vocab_size
    vocab = padded_vocab(cfg.vocab_size, spec.tp_size) / spec.tp_size
    return (4 + (2 if spec.act == 2 else 0)) * vocab
