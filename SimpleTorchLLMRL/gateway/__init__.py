"""An OpenAI-compatible endpoint that records exactly what the policy sampled (see `server.Gateway`)."""

from SimpleTorchLLMRL.gateway.server import Gateway, session_name

__all__ = ["Gateway", "session_name"]
