"""Agentic rollouts: interaction environments, the multi-turn generate loop, tools and the agent gateway."""
