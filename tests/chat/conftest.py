"""Tests of chat. Shared fixtures: tests/conftest.py (tokenizers, tiny models, the embedded calculator model);
shared helpers: tests/support/."""
