"""Bridges to the environment libraries users already have (verifiers, reasoning-gym, OpenEnv, textarena).

Each module imports its library only when used, and says which extra installs it when it is missing
(docs/environments.md). Import from the modules: `from SimpleTorchLLMRL.integrations.reasoning_gym import task`.
"""
