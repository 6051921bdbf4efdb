"""Plot the search run's held-out accuracy and search figures, and print them as a table.

The per-sample figures come from the reward log that ``reward.py`` writes into the run directory
(``search_rewards.jsonl``); held-out rows are grouped by the weight version that produced them (the training step of
the evaluation), training rollouts the same way.

Usage: python examples/search_r1/plot_curves.py RUN_DIR [--out docs/curves]
"""

from __future__ import annotations

import sys
from pathlib import Path

from reward import REWARD_LOG_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agentic_common"))
from reward_log import plot_main  # noqa: E402  (shared with the calculator)

FIGURES = {  # file stem -> (title, y label, curves: legend label -> (split, reward key))
    "search_r1_accuracy": ("Held-out accuracy (200 unseen towns)", "exact-match accuracy", {
        "held-out (greedy)": ("test", "correct"),
        "training rollouts (T=1, mean of 5 steps)": ("train", "correct"),
    }),
    "search_r1_tool_calls": ("Searches", "share of episodes", {
        "searched, held-out (greedy)": ("test", "called_tool"),
        "search found the answer, held-out (greedy)": ("test", "found"),
        "searched, training rollouts (T=1, mean of 5 steps)": ("train", "called_tool"),
    }),
}
COLUMNS = {"correct": "held-out accuracy", "called_tool": "episodes with a search",
           "tool_call_success": "tool-call success", "found": "searches that found the answer"}


def main(argv: list[str] | None = None) -> None:
    plot_main(argv, __doc__.split("\n\n")[0], REWARD_LOG_NAME, FIGURES, COLUMNS, "called_tool", "search rate")


if __name__ == "__main__":
    main()
