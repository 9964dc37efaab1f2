"""What each family can do, declared once: its tasks, segmenter, export recipe and processor.

A family's card (``models/cards/<family>.py``) declares a :class:`Capabilities`; this module imports
no family. Pipelines, export, the command line, dataset jobs and the site ask it, through
:func:`of` for a loaded model or ``card.family.capabilities`` for a card, and never look at module
names or probe a model with ``hasattr``. The names a capability holds (``"sam2"``, ``"sam2-edge"``)
are keys of the tables that implement them in the layers above (``pipelines.segment.SEGMENTERS``,
``export.edge.RECIPES``, ``pipelines.processors.PROCESSORS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# every task a family may serve: the `kestrel` command that runs it, and what it does
TASKS: dict[str, str] = {
    "classify": "top-k labels for images",
    "embed": "image features to a safetensors file",
    "zero-shot": "free-text labels scored against images",
    "similarity": "a table of image x text scores",
    "segment": "masks from point or box prompts",
}

SEGMENTERS = ("sam", "sam2")  # the promptable segmentation pipelines
RECIPES = ("entries", "sam2-edge")  # how `kestrel export` splits a model into programs
PROCESSORS = ("image", "sam", "sam2")  # how an image becomes the model's pixels
FEATURE_ENTRIES = ("features", "image_features", "forward")  # what `embed` reads


@dataclass(frozen=True)
class Capabilities:
    """What one family serves.

    ``tasks``: commands of :data:`TASKS` it runs. ``features``: the entry ``embed`` reads (its tokens are
    pooled, except ``image_features``, which is already one embedding). ``text``: it has a text tower
    (zero-shot, similarity). ``segmenter``: the promptable segmentation pipeline that runs it (also for
    ``segment --everything``). ``recipe``: the export recipe. ``processor``: its image pre-processing.
    """

    tasks: tuple[str, ...] = ()
    features: str | None = None
    text: bool = False
    segmenter: str | None = None
    recipe: str = "entries"
    processor: str = "image"

    def __post_init__(self) -> None:
        for name, value, known in (("task", self.tasks, tuple(TASKS)), ("segmenter", (self.segmenter,), SEGMENTERS),
                                   ("recipe", (self.recipe,), RECIPES), ("processor", (self.processor,), PROCESSORS),
                                   ("features entry", (self.features,), FEATURE_ENTRIES)):
            for v in value:
                if v is not None and v not in known:
                    raise ValueError(f"unknown {name} {v!r}; known: {', '.join(known)}")
        if "segment" in self.tasks and self.segmenter is None:
            raise ValueError("a family that serves segment names its segmenter")
        if "embed" in self.tasks and self.features is None:
            raise ValueError("a family that serves embed names its features entry")

    def serves(self, task: str) -> bool:
        return task in self.tasks


NONE = Capabilities()


def of(model: Any) -> Capabilities:
    """The capabilities of a model loaded by ``kestrel.load`` (its card family's); none for anything else."""
    loaded = getattr(model, "loaded", None)
    family = getattr(loaded, "family", None)
    return getattr(family, "capabilities", NONE)
