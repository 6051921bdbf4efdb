"""Relax: reinforcement-learning post-training for language, vision-language and omni models."""

__version__ = "0.1.0"
