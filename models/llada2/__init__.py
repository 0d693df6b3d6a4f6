from models.llada2.configuration_llada2_moe import LLaDA2MoeConfig
from models.llada2.modeling_llada2_moe import LLaDA2MoeModel, LLaDA2MoeModelLM

__all__ = ["LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM"]
