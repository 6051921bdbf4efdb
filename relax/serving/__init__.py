"""`relax serve`: the embedded inference engine behind SGLang's native HTTP protocol and the OpenAI protocol."""

from relax.backends.inference.batcher import RequestBatcher
from relax.serving.app import create_app

__all__ = ["RequestBatcher", "create_app"]
