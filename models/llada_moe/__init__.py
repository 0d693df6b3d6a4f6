from models.llada_moe.configuration_llada_moe import LLaDAMoEConfig
from models.llada_moe.modeling_llada_moe import LLaDAMoEModel, LLaDAMoEModelLM

__all__ = ["LLaDAMoEConfig", "LLaDAMoEModel", "LLaDAMoEModelLM"]
