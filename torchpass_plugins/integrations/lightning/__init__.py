"""Lightning strategies of torchpass; ``import torchpass_plugins`` registers their names."""

from torchpass_plugins.integrations.lightning.ddp import TorchPassDDPStrategy
from torchpass_plugins.integrations.lightning.fsdp import TorchPassFSDPStrategy

__all__ = ["TorchPassDDPStrategy", "TorchPassFSDPStrategy"]
