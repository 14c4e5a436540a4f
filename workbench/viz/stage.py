"""The explorer's stage: static pictures on a grid of fixed tracks, and what the chosen rank adds to them written as
ONE piece of HTML laid over the whole grid.

A rank change then costs one widget message: the rank's text (above the pictures) and the SVG marks of every
picture (inline ``<svg>``: no image to decode) absolutely placed over the PNGs, which are sent once per
parameter. The grid's first row is ``auto`` and holds nothing but the overlay's text: the overlay spans every
row, so that row takes the text's height and the pictures' rows start exactly where the overlay's picture
area does. Sizes are CSS pixels; grid items need a zero margin for the positions to hold.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HEADING_PX", "Slot", "Stage", "inline_svg", "stage"]

HEADING_PX = 26  # a heading row over each row of pictures

_PROLOG = re.compile(rb"^.*?(?=<svg\b)", re.S)  # XML declaration and DOCTYPE: meaningless inside HTML
_METADATA = re.compile(rb"<metadata>.*?</metadata>\s*", re.S)
# matplotlib's <style> sets line joins and caps on every element; inline, it would restyle the whole page (and
# restyle it again on every change): the same settings become inherited attributes of the root instead
_STYLE = re.compile(rb"<defs>\s*<style[^>]*>[^<]*</style>\s*</defs>\s*", re.S)
_MPL_STYLE = ' stroke-linejoin="round" stroke-linecap="butt"'


@dataclass(frozen=True, slots=True)
class Slot:
    """A picture's place on the stage: its grid cell (1-based grid lines, the text row included) and its box in
    CSS pixels from the top left of the pictures' area (under the text)."""

    name: str
    row: int
    column: int
    left: float
    top: float
    width: float
    height: float

    @property
    def grid_area(self) -> str:
        """The CSS ``grid-area`` of the picture's cell."""
        return f"{self.row} / {self.column} / {self.row + 1} / {self.column + 1}"


@dataclass(frozen=True, slots=True)
class Stage:
    """Rows of pictures, each under a heading, on a grid of fixed tracks; see ``stage``."""

    columns: tuple[float, ...]
    rows: tuple[float, ...]  # below the text row: heading, pictures, heading, pictures, ...
    slots: tuple[Slot, ...]
    headings: tuple[tuple[str, float], ...]  # (HTML, top)

    @property
    def width(self) -> float:
        return sum(self.columns)

    @property
    def height(self) -> float:
        return sum(self.rows)

    @property
    def grid_template_columns(self) -> str:
        return " ".join(_px(c) for c in self.columns)

    @property
    def grid_template_rows(self) -> str:
        return " ".join(["auto", *(_px(r) for r in self.rows)])

    @property
    def overlay_area(self) -> str:
        """The CSS ``grid-area`` of the overlay: every row and column."""
        return f"1 / 1 / {len(self.rows) + 2} / {len(self.columns) + 1}"

    def slot(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)

    def overlay(self, text: str, marks: Mapping[str, bytes], *, rank: int) -> str:
        """The HTML laid over the grid: ``text`` (HTML) on top, then the headings and each picture's SVG marks
        (``marks`` by slot name) over its picture."""
        parts = [f'<div class="wb-rank" data-rank="{rank}"><div class="wb-text">{text}</div>'
                 f'<div class="wb-stage" style="position:relative;width:{_px(self.width)};'
                 f'height:{_px(self.height)}">']
        parts += [f'<div class="wb-heading" style="position:absolute;left:0;top:{_px(top)};'
                  f'line-height:{HEADING_PX}px">{heading}</div>' for heading, top in self.headings]
        parts += [inline_svg(marks[s.name], s) for s in self.slots if s.name in marks]
        parts.append("</div></div>")
        return "".join(parts)


def stage(rows: Sequence[tuple[str, Sequence[tuple[str, float, float]]]]) -> Stage:
    """The stage of ``rows``: each is ``(heading HTML, [(name, css width, css height), ...])``, its pictures side
    by side left to right; a column is as wide as its widest picture, a row as tall as its tallest."""
    ncols = max(len(pictures) for _, pictures in rows)
    columns = [0.0] * ncols
    for _, pictures in rows:
        for c, (_, width, _) in enumerate(pictures):
            columns[c] = max(columns[c], width)
    heights: list[float] = []
    slots: list[Slot] = []
    headings: list[tuple[str, float]] = []
    for heading, pictures in rows:
        headings.append((heading, sum(heights)))
        heights.append(HEADING_PX)
        top = sum(heights)
        row = len(heights) + 2  # grid lines: 1 starts the text row, the heading's row comes next
        for c, (name, width, height) in enumerate(pictures):
            slots.append(Slot(name, row, c + 1, sum(columns[:c]), top, width, height))
        heights.append(max(height for _, _, height in pictures))
    return Stage(tuple(columns), tuple(heights), tuple(slots), tuple(headings))


def inline_svg(svg: bytes, slot: Slot) -> str:
    """``svg`` (a whole SVG document, as ``_style.artists_svg`` or ``zoom_svg`` write it) as an inline ``<svg>``
    element filling ``slot``'s box: no XML prolog, metadata or page-wide style."""
    data = _METADATA.sub(b"", _PROLOG.sub(b"", bytes(svg), count=1), count=1)
    styled = _STYLE.search(data) is not None
    data = _STYLE.sub(b"", data, count=1)
    text = data.decode()
    place = (f' style="position:absolute;left:{_px(slot.left)};top:{_px(slot.top)};width:{_px(slot.width)};'
             f'height:{_px(slot.height)}"' + (_MPL_STYLE if styled else "")
             + f' data-picture="{html.escape(slot.name)}"')
    return text.replace("<svg", "<svg" + place, 1)


def _px(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") + "px"
