from models.dream.configuration_dream import DreamConfig
from models.dream.modeling_dream import DreamBaseModel, DreamModel

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel"]
