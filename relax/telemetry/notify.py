"""Run notifications through Apprise (``--notify-urls``): start, finish, a graceful stop, and failure.

Apprise speaks to some hundred services from one URL scheme each (``tgram://``, ``slack://``, ``mailto://``,
``json://`` for a plain webhook). The URLs carry tokens, so they are secrets: never logged or saved, and a URL that
Apprise cannot parse is named by its position, not its text. Message bodies have every secret setting's value
redacted. A notification that cannot be delivered is logged as a warning and never stops the run.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable

logger = logging.getLogger("relax")

REDACTED = "[redacted]"


def split_urls(text: str | None) -> list[str]:
    """``--notify-urls``: comma separated, as upstream's flag."""
    return [url.strip() for url in (text or "").split(",") if url.strip()]


def invalid_url_positions(urls: list[str]) -> list[int]:
    """1-based positions of the URLs Apprise does not accept."""
    import apprise

    return [index for index, url in enumerate(urls, 1) if not apprise.Apprise().add(url)]


class Notifier:
    def __init__(self, urls: list[str], secrets: Iterable[str] = (), run_name: str = "relax"):
        self._secrets = sorted({s for s in (*secrets, *urls) if s}, key=len, reverse=True)
        self.run_name = run_name
        self._apprise = None
        if urls:
            import apprise

            self._apprise = apprise.Apprise()
            for url in urls:
                self._apprise.add(url)

    @property
    def enabled(self) -> bool:
        return self._apprise is not None

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def send(self, event: str, body: str, failure: bool = False) -> bool:
        """Deliver one message; False (and a warning) when no target took it."""
        if self._apprise is None:
            return False
        import apprise

        title = f"[{self.run_name}] {event} on {socket.gethostname()}"
        try:
            delivered = self._apprise.notify(title=self.redact(title), body=self.redact(body),
                                             notify_type=apprise.NotifyType.FAILURE if failure else
                                             apprise.NotifyType.INFO)
        except Exception as err:  # noqa: BLE001 - a notification must never end a run
            logger.warning("notification %r not delivered: %s", event, self.redact(f"{type(err).__name__}: {err}"))
            return False
        if not delivered:
            logger.warning("notification %r not delivered to every --notify-urls target", event)
        return bool(delivered)

    def started(self, run_dir: str, total_steps: int | None, resumed: bool = False) -> None:
        self.send("resumed" if resumed else "started", f"run directory {run_dir}; {total_steps} steps")

    def finished(self, run_dir: str, step: int, metrics: dict[str, float]) -> None:
        shown = {k: metrics[k] for k in ("rollout/reward_mean", "eval/accuracy", "train/loss") if k in metrics}
        figures = ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
        self.send("finished", f"run directory {run_dir}; {step} steps" + (f"; {figures}" if figures else ""))

    def stopped(self, run_dir: str, step: int, signal_name: str) -> None:
        self.send("stopped", f"stopped by {signal_name} after step {step} with a checkpoint; resume with "
                             f"--load {run_dir}")

    def failed(self, run_dir: str, error: str) -> None:
        self.send("failed", f"run directory {run_dir}: {error}", failure=True)
