"""`relax serve`: the embedded inference engine behind SGLang's native HTTP protocol and the OpenAI protocol."""

from relax.serving.app import create_app
from relax.serving.batcher import RequestBatcher

__all__ = ["RequestBatcher", "create_app"]
