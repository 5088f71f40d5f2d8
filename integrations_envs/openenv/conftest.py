"""Run by this environment's own pytest (tests/integrations/test_integrations_own_envs.py starts it from the repository root)."""

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # sum_env
torch.set_num_threads(1)
