"""Bridges to the environment libraries users already have (verifiers, reasoning-gym, OpenEnv, textarena).

Each module imports its library only when used, and says which extra installs it when it is missing
(docs/environments.md). Import the modules: `from SimpleTorchLLMRL.integrations import reasoning_gym`.
"""
