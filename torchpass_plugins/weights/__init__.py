"""Fresh weights for processes outside the job (rollout replicas, evaluators): a trainer rank publishes
versioned copies of its weights, and any number of subscribers receive each newest version whole."""

from torchpass_plugins.weights.publisher import WeightPublisher
from torchpass_plugins.weights.subscriber import TokenRefused, WeightSubscriber

__all__ = ["TokenRefused", "WeightPublisher", "WeightSubscriber"]
