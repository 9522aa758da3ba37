"""Layouts: an output size with its reference images or inpaint source, one sequence length each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.contract import references as refs
from neuron_ui.contract.checks import check_size

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution


def validate_resolution(resolution: object, presets: tuple[Resolution, ...]) -> Resolution:
    return check_size(resolution, presets, long="resolution {value} is not a preset; allowed: {allowed}",
                      unparsed="{error}; allowed: {allowed}",
                      outside="resolution {size} is not a preset; allowed: {allowed}")


@dataclass(frozen=True)
class Layout:
    """What the transformer's image sequence is made of: the output, the source image when inpainting (the
    inpaint pipeline appends its latents as a condition), and each reference. Its length is the graph's shape."""

    resolution: Resolution
    references: tuple[Resolution, ...] = ()
    inpaint: bool = False

    @property
    def tokens(self) -> int:
        return self.resolution.tokens * (2 if self.inpaint else 1) + sum(r.tokens for r in self.references)

    @property
    def plain(self) -> bool:
        return not self.references and not self.inpaint

    def __str__(self) -> str:
        text = f"inpaint {self.resolution}" if self.inpaint else str(self.resolution)
        if self.references:
            sizes = sorted({str(r) for r in self.references})
            count = len(self.references)
            text += f" + {count} ref{'s' if count > 1 else ''} {', '.join(sizes)}"
        return text


@dataclass(frozen=True)
class Layouts:
    """The layouts a server allows: its presets, plain or inpainted, with 0..max references of one size."""

    presets: tuple[Resolution, ...]
    reference_sizes: tuple[Resolution, ...] = refs.REFERENCE_SIZES
    max_references: int = 2

    def all(self) -> list[Layout]:
        reference_sets = [()] + [(size,) * count for size in self.reference_sizes
                                 for count in range(1, self.max_references + 1)]
        return [Layout(p, r, inpaint) for p in self.presets for inpaint in (False, True) for r in reference_sets]

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        """The layout a request would make; ValueError names what is allowed."""
        preset = validate_resolution(resolution, self.presets)
        if not isinstance(references, int) or references < 0:
            raise ValueError(f"references must be a count from 0, got {references!r}")
        if references > self.max_references:  # the words refs.fit_references uses, whichever check comes first
            raise ValueError(f"{references} reference images; this server takes at most {self.max_references}")
        # checked without references too (the page always sends its choice), where it changes nothing
        size = refs.validate_reference_size(reference_size or str(self.reference_sizes[0]), self.reference_sizes)
        return Layout(preset, (size,) * references, inpaint)
