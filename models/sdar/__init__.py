from models.sdar.configuration_sdar import SDARConfig
from models.sdar.modeling_sdar import SDARForCausalLM, SDARModel

__all__ = ["SDARConfig", "SDARForCausalLM", "SDARModel"]
