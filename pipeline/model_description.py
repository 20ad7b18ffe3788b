"""What pairmine needs to know about an encoder, read from the model instead of guessed from its name.

An encoder used by pairmine needs three settings that its weights do not carry: the text put before queries and
before passages (E5 was trained with ``"query: "`` / ``"passage: "``, all-MiniLM-L6-v2 with none), and the anchor
threshold, a centrality value whose scale depends on the model (0.675 for all-MiniLM-L6-v2, chosen on the shipped
sample; 0.825 for E5, the paper's value, seed 000). Resolution, first match wins:

1. explicit config (``embed.passage_prefix`` / ``embed.query_prefix`` / ``anchors.threshold``);
2. the model's own description, :data:`DESCRIPTION_FILE` in its folder, which ``pairmine train`` writes next to
   the exported weights (the base model's prefixes, the threshold of the groups it was trained on);
3. a table of known model families (:data:`KNOWN_FAMILIES`: all-MiniLM-L6-v2, E5);
4. an unknown model: no prefixes, and no threshold (``pairmine mine`` then stops with an error that names
   ``pairmine calibrate``, which measures one on a sample).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass

from pairmine.operators.errors import PairmineError

log = logging.getLogger("pairmine")

DESCRIPTION_FILE = "pairmine_model.json"
FORMAT = 1
DEFAULT_MINILM_THRESHOLD = 0.675  # docs/mining.md "Anchor threshold": the paper's 68% coverage on the shipped sample
E5_THRESHOLD = 0.825  # seed 000, FineWeb with E5


class ModelDescriptionError(PairmineError, ValueError):
    """A model's :data:`DESCRIPTION_FILE` exists but cannot be used (not JSON, wrong types, newer format).
    User-fixable: the message names the file and the field."""


@dataclass(frozen=True)
class ModelDescription:
    """The settings of one encoder that its weights do not carry.

    Attributes:
        query_prefix, passage_prefix: text put before each query / passage ("" for none).
        anchor_threshold: centrality above which a passage is an anchor (SPEC "Anchors"), on this model's cosine
            scale; None when unknown.
        pooling: how token vectors become one vector; pairmine's embedder and trainer use "mean" (over the
            attention mask) followed by L2 normalisation.
        base_model: the model this one was trained from ("" for a model not trained by pairmine).
        threshold_source: where ``anchor_threshold`` came from, in words (logged and written in the manifest).
        source: where this description came from: the description file's path, ``known family <name>``, or
            ``unknown model``.
        pairmine_version: the pairmine that wrote the description file ("" otherwise).
    """

    query_prefix: str = ""
    passage_prefix: str = ""
    anchor_threshold: float | None = None
    pooling: str = "mean"
    base_model: str = ""
    threshold_source: str = ""
    source: str = "unknown model"
    pairmine_version: str = ""

    def to_json(self) -> dict:
        """The description file's content (``source`` is where a description was read from, so it is left out)."""
        data = {"format": FORMAT, **dataclasses.asdict(self)}
        data.pop("source")
        return data


def _last_segment(model: str) -> str:
    return model.lower().replace("\\", "/").rstrip("/").split("/")[-1]


def _is_minilm(model: str) -> bool:
    return model == "" or "all-minilm-l6-v2" in model.lower().replace("_", "-")


def _is_e5(model: str) -> bool:
    return re.search(r"(?<![a-z0-9])e5(?![0-9])", _last_segment(model)) is not None


KNOWN_FAMILIES: tuple[tuple[str, object, ModelDescription], ...] = (
    ("all-MiniLM-L6-v2", _is_minilm,
     ModelDescription("", "", DEFAULT_MINILM_THRESHOLD, threshold_source="the default model's value, "
                      "docs/mining.md 'Anchor threshold'", source="known family all-MiniLM-L6-v2")),
    ("E5", _is_e5,
     ModelDescription("query: ", "passage: ", E5_THRESHOLD, threshold_source="E5's value on FineWeb (seed 000)",
                      source="known family E5")),
)
"""(name, matcher of ``embed.model``, description): "" and any path or hub id naming all-MiniLM-L6-v2 are the
default model; a last path segment with the word ``e5`` (``intfloat/e5-base-v2``, ``multilingual-e5-small``) is
E5."""


def read_description(model: str) -> ModelDescription | None:
    """The description file of a local model folder, or None when there is none (a hub id, or no file).

    Raises:
        ModelDescriptionError: the file exists but is not a JSON object of the expected fields and types, or was
            written by a newer pairmine (``format`` above :data:`FORMAT`).
    """
    path = os.path.join(model, DESCRIPTION_FILE) if model else ""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelDescriptionError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelDescriptionError(f"{path} must hold a JSON object")
    if int(data.get("format", 1)) > FORMAT:
        raise ModelDescriptionError(f"{path} has format {data['format']}, newer than this pairmine reads ({FORMAT}): "
                                    "upgrade pairmine")
    known = {f.name for f in dataclasses.fields(ModelDescription)} - {"source"}
    values = {k: v for k, v in data.items() if k in known}
    for key in ("query_prefix", "passage_prefix", "pooling", "base_model", "threshold_source", "pairmine_version"):
        if key in values and not isinstance(values[key], str):
            raise ModelDescriptionError(f"{path}: {key} must be a string, not {values[key]!r}")
    t = values.get("anchor_threshold")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not -1.0 <= t <= 1.0):
        raise ModelDescriptionError(f"{path}: anchor_threshold must be a number in [-1, 1] or null, not {t!r}")
    if values.get("pooling", "mean") != "mean":
        raise ModelDescriptionError(f"{path}: pooling {values['pooling']!r} is not supported (pairmine pools 'mean')")
    return ModelDescription(**{**values, "anchor_threshold": None if t is None else float(t)}, source=path)


def describe_model(model: str) -> ModelDescription:
    """The description of ``model`` (``embed.model`` / ``train.model``: "" for the default, a folder or a hub id):
    its description file, else the first matching known family, else an unknown model (no prefixes, no threshold).

    Raises:
        ModelDescriptionError: see :func:`read_description`.
    """
    found = read_description(model)
    if found is not None:
        return found
    for _name, matches, description in KNOWN_FAMILIES:
        if matches(model):
            return description
    return ModelDescription()


def write_description(folder: str, description: ModelDescription) -> str:
    """Write ``description`` as :data:`DESCRIPTION_FILE` into a local ``folder``; returns the file's path."""
    path = os.path.join(folder, DESCRIPTION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(description.to_json(), f, indent=2)
        f.write("\n")
    return path
