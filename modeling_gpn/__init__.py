"""gpn: Grounded Prediction Networks as a first-class transformers model.

Importing this package registers GPN with `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
`AutoModelForSequenceClassification`, so `AutoModelForCausalLM.from_pretrained(folder)` works without
`trust_remote_code`. Folders written by
`save_pretrained` also carry the modeling files and an `auto_map`, so they load with
`trust_remote_code=True` where this package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .configuration_gpn import GPNConfig
from .modeling_gpn import (
    GPNCache,
    GPNForCausalLM,
    GPNForSequenceClassification,
    GPNModel,
    GPNPreTrainedModel,
    GPNStateFileError,
)

__version__ = "0.1.0"

AutoConfig.register(GPNConfig.model_type, GPNConfig, exist_ok=True)
AutoModel.register(GPNConfig, GPNModel, exist_ok=True)
AutoModelForCausalLM.register(GPNConfig, GPNForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(GPNConfig, GPNForSequenceClassification, exist_ok=True)

__all__ = [
    "GPNCache",
    "GPNConfig",
    "GPNForCausalLM",
    "GPNForSequenceClassification",
    "GPNModel",
    "GPNPreTrainedModel",
    "GPNStateFileError",
    "__version__",
]
