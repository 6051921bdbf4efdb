"""Data types and loading: `Sample`, prompt datasets, chat templates (dependency-light)."""

from relax.data.sample import Sample, SampleStatus

__all__ = ["Sample", "SampleStatus"]
