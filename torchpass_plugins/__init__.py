"""torchpass-plugins: hot spares and live recovery for PyTorch Lightning and Accelerate.

Importing the package registers the strategy names (Lightning has no entry point for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from torchpass_plugins.callback import TorchPassCallback
from torchpass_plugins.environment import TorchPassEnvironment
from torchpass_plugins.strategies import TorchPassDDPStrategy, TorchPassFSDPStrategy

__version__ = "0.1.0"

for _strategy in (TorchPassDDPStrategy, TorchPassFSDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)

__all__ = ["TorchPassCallback", "TorchPassDDPStrategy", "TorchPassEnvironment", "TorchPassFSDPStrategy", "__version__"]
