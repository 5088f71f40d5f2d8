"""Tiny tokenizers and models built locally (never downloaded), and the embedded `TINY_CALC` model.

    from SimpleTorchLLMRL.testing.tiny import tiny_tokenizer, tiny_model, TINY_CALC
"""
