"""Advantages and losses from numbers: the pure math (rl_math), the registries of advantage
estimators and policy losses, and Algorithm, which applies them as the config says."""
