"""Tests of distributed. Shared fixtures: tests/conftest.py (tokenizers, tiny models, the embedded calculator model);
shared helpers: tests/support/."""
