"""The model's module names: the contract between model.py, the regimes and the planner (torch-free).

``model.py`` builds modules under these names (a test checks it); the TP plan, the pipeline split, the
checkpoints and the planner's counts all refer to them, so a name lives here once.
"""

from __future__ import annotations

# before the layers (the first pipeline stage); rel_emb: T5's relative-position table (pos_embedding=relative)
FIRST_STAGE_MODULES = ("tok_emb", "pos_emb", "type_emb", "rel_emb", "emb_norm")
EMBEDDING_TABLES = FIRST_STAGE_MODULES[:3]  # the lookup tables (freeze preset `embeddings`), not rel_emb, emb_norm
# one transformer block's parameterised modules (leaf names): q_norm / k_norm (model.qk_norm) sit in ``attn``,
# attn_post_norm / mlp_post_norm (norm_placement sandwich) on the layer, after their branch; latent attention
# (model.kv_lora_rank, model_mla.py) has q_a_proj .. kv_b_proj in place of k_proj / v_proj (and of q_proj with a
# q_lora_rank)
LAYER_MODULES = ("attn_norm", "q_proj", "k_proj", "v_proj", "q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj",
                 "kv_a_norm", "kv_b_proj", "o_proj", "q_norm", "k_norm", "attn_post_norm", "mlp_norm", "up_proj",
                 "gate_proj", "down_proj", "mlp_post_norm")
# after the layers (the last pipeline stage): the Transformer's attributes, in module order; ``output_bias`` (BERT's
# decoder bias, model.mlm_head) is a parameter the Transformer holds itself, the others are modules
LAST_STAGE_MODULES = ("final_norm", "mlm_transform", "head", "output_bias", "pooler", "nsp_head")
LAST_STAGE_PARAMETERS = ("output_bias",)  # of LAST_STAGE_MODULES, the parameters (no module under that name)
MLM_TRANSFORM_LEAVES = ("dense", "norm")  # mlm_transform's modules (BERT's BertPredictionHeadTransform)
# the last stage's parameterised names (what a freeze pattern matches, the planner's tail counts), module order
TAIL_NAMES = tuple(n for top in LAST_STAGE_MODULES
                   for n in ([f"{top}.{leaf}" for leaf in MLM_TRANSFORM_LEAVES] if top == "mlm_transform" else [top]))
# A mixture-of-experts layer (model_moe.py) has ``moe`` where a dense layer has ``mlp``: router, experts by global
# index (each the MLP's up/gate/down), and the optional shared expert (an MLP every token passes through)
MLP_LEAVES = ("up_proj", "gate_proj", "down_proj")  # an MLP's linears: a dense layer's, an expert's, the shared one's
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj")  # LoRA can adapt these
# An encoder-decoder (model.n_decoder_layers > 0, model_seq2seq.py): ``layers`` is the encoder stack, closed by
# ``enc_norm`` (pre-norm); the decoder stack ``dec_layers`` has its own position tables (its token embedding is
# ``tok_emb``), and each of its layers adds cross-attention between self-attention and the MLP
ENCODER_LAST_MODULES = ("enc_norm",)  # after the encoder's layers (its last pipeline stage)
DECODER_FIRST_MODULES = ("dec_pos_emb", "dec_rel_emb")  # the decoder's tables (on the first pipeline stage, which
# embeds both stacks' inputs)
CROSS_ATTENTION_MODULES = ("cross_norm", "cross_attn.q_proj", "cross_attn.k_proj", "cross_attn.v_proj",
                           "cross_attn.o_proj")  # a decoder layer's, by their names under the layer
_MLP_FROM = LAYER_MODULES.index("mlp_norm")
DECODER_LAYER_MODULES = LAYER_MODULES[:_MLP_FROM] + CROSS_ATTENTION_MODULES + LAYER_MODULES[_MLP_FROM:]  # module order
