from models.llada.configuration_llada import LLaDAConfig, MMadaConfig
from models.llada.modeling_llada import LLaDAModel, LLaDAModelLM, MMadaModelLM

__all__ = ["LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "MMadaConfig", "MMadaModelLM"]
