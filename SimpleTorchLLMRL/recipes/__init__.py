"""Recipes: applications built only from the library's public parts; nothing in the library imports them.

    recipes/calculator/   what main.py runs: the arithmetic task, CLI, data, train loop, evaluation, plots
    recipes/router_r1/    Router-R1: a policy that thinks, routes sub-questions to a pool of LLMs, answers
"""
