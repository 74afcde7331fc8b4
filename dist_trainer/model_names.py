"""The model's module names: the contract between model.py, the regimes and the planner (torch-free).

``model.py`` builds modules under these names (a test checks it); the TP plan, the pipeline split, the
checkpoints and the planner's counts all refer to them, so a name lives here once.
"""

from __future__ import annotations

FIRST_STAGE_MODULES = ("tok_emb", "pos_emb", "type_emb", "emb_norm")  # before the layers (the first pipeline stage)
EMBEDDING_TABLES = FIRST_STAGE_MODULES[:3]  # the lookup tables (freeze preset `embeddings`), not emb_norm
LAYER_MODULES = ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "mlp_norm", "up_proj", "gate_proj",
                 "down_proj")  # one transformer block's parameterised modules (leaf names)
LAST_STAGE_MODULES = ("final_norm", "head", "pooler")  # after the layers (the last pipeline stage)
# A mixture-of-experts layer (model_moe.py) has ``moe`` where a dense layer has ``mlp``: router, experts by global
# index (each the MLP's up/gate/down), and the optional shared expert (an MLP every token passes through)
MLP_LEAVES = ("up_proj", "gate_proj", "down_proj")  # an MLP's linears: a dense layer's, an expert's, the shared one's
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "gate_proj", "down_proj")  # LoRA can adapt these
