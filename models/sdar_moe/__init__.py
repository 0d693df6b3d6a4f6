from models.sdar_moe.configuration_sdar_moe import SDARMoeConfig
from models.sdar_moe.modeling_sdar_moe import SDARMoeForCausalLM, SDARMoeModel

__all__ = ["SDARMoeConfig", "SDARMoeForCausalLM", "SDARMoeModel"]
