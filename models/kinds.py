"""Each model_base's attention kind, torch-free, so configs are checked before heavy imports (models/registry.py's
FAMILIES reads it: one place)."""

ATTENTION_OF = {"trado": "block", "sdar": "block", "sdar_moe": "block", "dream": "full", "llada": "full",
                "mmada": "full", "llada2": "block", "llada_moe": "full"}
