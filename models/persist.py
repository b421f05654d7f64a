"""Saving and loading models with skops and an explicit allow-list of types.

A model file is a skops archive of a plain dict (format name, version, feature names,
horizon, threshold, metadata, the calibrated classifier). Loading lists the types the
file would instantiate (:func:`skops.io.get_untrusted_types`) and refuses the file,
naming them, when any is outside :data:`TRUSTED_TYPES`; nothing is unpickled. Only then
is it loaded with exactly that list trusted.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Final

import skops.io as sio

from forewarn.errors import InputError
from forewarn.models.predictor import FailurePredictor

__all__ = [
    "FORMAT",
    "TRUSTED_TYPES",
    "ModelError",
    "UntrustedModelError",
    "default_model_path",
    "load_default_model",
    "load_model",
    "save_model",
]

FORMAT: Final = "forewarn.models/failure-predictor"
VERSION: Final = 1

TRUSTED_TYPES: Final = (
    "builtins.dict",
    "builtins.list",
    "builtins.tuple",
    "builtins.float",
    "builtins.int",
    "builtins.str",
    "builtins.bool",
    "numpy.dtype",
    "numpy.ndarray",
    "numpy.float64",
    "numpy.int64",
    "numpy.uint8",
    "numpy.uint32",
    "numpy.int8",
    "numpy.intp",
    "numpy.random.RandomState",
    "numpy.random._mt19937.MT19937",
    "sklearn.calibration.CalibratedClassifierCV",
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.frozen._frozen.FrozenEstimator",
    "sklearn.ensemble._hist_gradient_boosting.gradient_boosting.HistGradientBoostingClassifier",
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn._loss.loss.HalfBinomialLoss",
    "sklearn._loss.link.LogitLink",
    "sklearn._loss.link.Interval",
    "sklearn._loss._loss.CyHalfBinomialLoss",
    "sklearn.isotonic.IsotonicRegression",
    "sklearn.model_selection._split.StratifiedKFold",
    "sklearn.ensemble._iforest.IsolationForest",
    "sklearn.tree._classes.ExtraTreeRegressor",
    "sklearn.tree._tree.Tree",
    "sklearn.utils._bunch.Bunch",
    "scipy.interpolate._interpolate.interp1d",
    "forewarn.models.rules_forest.RulesForest",
)
"""Every type a forewarn model file may contain. Anything else is refused."""


class ModelError(InputError, ValueError):
    """A model file is unusable: wrong format, missing key or unreadable."""


class UntrustedModelError(ModelError):
    """A model file contains types outside :data:`TRUSTED_TYPES`."""


def save_model(model: FailurePredictor, path: str | Path, extra: dict[str, Any] | None = None
               ) -> Path:
    """Write ``model`` to ``path`` (a ``.skops`` file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    obj: dict[str, Any] = {
        "format": FORMAT, "version": VERSION,
        "feature_names": list(model.feature_names), "horizon_s": float(model.horizon_s),
        "threshold": float(model.threshold), "metadata": dict(model.metadata),
        "classifier": model.classifier, "extra": dict(extra or {}),
    }
    sio.dump(obj, p)
    return p


def load_model(path: str | Path) -> FailurePredictor:
    """Load a model file, refusing any type outside :data:`TRUSTED_TYPES`.

    Raises :class:`UntrustedModelError` naming the refused types, or
    :class:`ModelError` when the file is not a forewarn model.
    """
    p = Path(path)
    try:
        untrusted = sio.get_untrusted_types(file=p)
    except Exception as exc:
        raise ModelError(f"{p}: not a readable skops model file: {exc}") from None
    refused = sorted(set(untrusted) - set(TRUSTED_TYPES))
    if refused:
        raise UntrustedModelError(
            f"{p}: refusing to load model: it contains types outside forewarn's allow-list: "
            f"{', '.join(refused)}")
    try:
        obj = sio.load(p, trusted=list(untrusted))
    except Exception as exc:
        raise ModelError(f"{p}: could not load model: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ModelError(f"{p}: not a forewarn failure-predictor model (format "
                         f"{obj.get('format') if isinstance(obj, dict) else type(obj).__name__})")
    if int(obj.get("version", 0)) > VERSION:
        raise ModelError(f"{p}: model version {obj.get('version')} is newer than {VERSION}")
    try:
        return FailurePredictor(
            classifier=obj["classifier"], feature_names=tuple(obj["feature_names"]),
            horizon_s=float(obj["horizon_s"]), threshold=float(obj["threshold"]),
            metadata=dict(obj.get("metadata", {})),
        )
    except KeyError as exc:
        raise ModelError(f"{p}: model file lacks key {exc}") from None


def default_model_path() -> Path:
    """Where the shipped default model lives (package data)."""
    return Path(str(resources.files("forewarn.models").joinpath("data/default_model.skops")))


def load_default_model() -> FailurePredictor:
    """Load the model that ships with forewarn (the collector calls this at start)."""
    return load_model(default_model_path())
