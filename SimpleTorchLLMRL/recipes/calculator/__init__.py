"""The calculator GRPO recipe behind `main.py`: a tiny model learns to call a calculator tool and box the answer
(docs/recipes.md lists its modules)."""
