"""Plot the calculator run's held-out accuracy and tool-call success, and print them as a table.

The rollout logs only the reward's ``score``; the per-sample tool figures come from the reward log that
``reward.py`` writes into the run directory (``calculator_rewards.jsonl``). Held-out rows are grouped by the weight
version that produced them, which is the training step of the evaluation; training rollouts are grouped the same way
(their version is the step whose weights sampled them).

Usage: python examples/agentic_calculator/plot_curves.py RUN_DIR [--out docs/curves]
"""

from __future__ import annotations

import sys
from pathlib import Path

from reward import REWARD_LOG_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agentic_common"))
from reward_log import plot_main  # noqa: E402  (shared with search_r1)

FIGURES = {  # file stem -> (title, y label, curves: legend label -> (split, reward key))
    "agentic_calculator_accuracy": ("Held-out accuracy (200 problems)", "exact-match accuracy", {
        "held-out (greedy)": ("test", "correct"),
        "training rollouts (T=1, mean of 5 steps)": ("train", "correct"),
    }),
    "agentic_calculator_tool_success": ("Tool calls", "share", {
        "tool-call success, held-out (greedy)": ("test", "tool_call_success"),
        "tool-call success, training rollouts (T=1, mean of 5 steps)": ("train", "tool_call_success"),
        "calls with the right operands, held-out (greedy)": ("test", "correct_call"),
    }),
}
COLUMNS = {"correct": "held-out accuracy", "tool_call_success": "tool-call success",
           "called_tool": "episodes with a call", "correct_call": "calls with the right operands"}


def main(argv: list[str] | None = None) -> None:
    plot_main(argv, __doc__.split("\n\n")[0], REWARD_LOG_NAME, FIGURES, COLUMNS, "tool_call_success", "tool-call success")


if __name__ == "__main__":
    main()
