"""One minute's features and probabilities in the live scorer
(:class:`~forewarn.models.live.LiveScorer`): computed once a minute and reused by the
scorings after it in that minute."""

from __future__ import annotations

import dataclasses

import numpy as np

from forewarn.models.predictor import FailurePredictor

__all__ = ["MinuteScores", "feature_matrix"]


@dataclasses.dataclass(frozen=True)
class MinuteScores:
    """One minute's features and probabilities of the GPU slots ``slots`` (ascending)."""

    minute: int
    at: float
    """The scoring time they were computed for (a scoring in parts keeps its minute)."""
    model: FailurePredictor
    slots: np.ndarray
    feats: dict[str, np.ndarray]
    probs: np.ndarray
    matrix: np.ndarray
    """The model's feature matrix of :attr:`slots` (for drift)."""

    def positions(self, slots: np.ndarray) -> np.ndarray | None:
        """Where each of ``slots`` (ascending) is in :attr:`slots`; None when one of them
        was not scored this minute."""
        pos = np.searchsorted(self.slots, slots)
        if len(slots) and (pos[-1] >= len(self.slots)
                           or not np.array_equal(self.slots[pos], slots)):
            return None
        return pos


def feature_matrix(feats: dict[str, np.ndarray], model: FailurePredictor) -> np.ndarray:
    """The model's feature matrix, one column after another in memory: a tree visits the
    rows in order and reads a few features of each, so columns laid out whole keep those
    reads sequential (it predicts about 2.5 times faster than on rows laid out whole)."""
    names = model.feature_names
    x = np.empty((len(feats[names[0]]), len(names)), order="F")
    for j, c in enumerate(names):
        x[:, j] = feats[c]
    return x
